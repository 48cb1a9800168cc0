"""Every hardware difference in one place: device choice, dtype choice, sync, memory probes."""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from types import ModuleType
from typing import Callable

import torch

from flatserve.memory import MemoryProbe


def select_device(name: str) -> torch.device:
    """`auto` picks cuda, then mps, then cpu."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if name not in ("cpu", "mps") and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda or mps")
    return torch.device(name)


def default_backend(device: torch.device) -> str:
    """Triton on CUDA; on the CPU the C++ decode kernel where it builds (it needs a C++
    compiler: the first start compiles it, ~40 s on 2 cores, then it is cached); torch else."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        from flatserve.attention import cpu_backend

        return "cpu" if cpu_backend.available() else "torch"
    return "torch"


# Attention backends tied to one device type ("torch" runs anywhere).
_BACKEND_DEVICE = {"triton": "cuda", "cpu": "cpu", "cpu-sdpa": "cpu"}


def check_backend(backend: str, device: torch.device) -> None:
    """A backend named for another device is refused before anything loads (the C++ kernels
    would read CUDA memory from the host; Triton cannot run on the CPU)."""
    need = _BACKEND_DEVICE.get(backend)
    if need is not None and device.type != need:
        raise ValueError(f"attention backend {backend!r} runs on {need}, but the device is "
                         f"{device.type}; use --attention-backend torch or --device {need}")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (Linux); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(f.read().split())
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls beat fp32. Without them bf16 is emulated and slower."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def cpu_has_amx_bf16() -> bool:
    """AMX bf16 tiles (Sapphire Rapids and later): flatserve/model/amx.py's kernel."""
    return "amx_bf16" in _cpu_flags()


def cpu_has_avx2_fma() -> bool:
    """AVX2 + FMA + F16C (Haswell / Zen 1 and later): flatserve/model/avx2.py's kernel."""
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def build_cpu_extension(name: str, source: str) -> object:
    """Compile one C++ source into a module with this machine's compiler (cached by torch under
    ~/.cache/torch_extensions); raises where there is no compiler/ninja/headers.

    -march=native: the build runs on the machine that uses it. torch caches by source and flags,
    not by CPU, so a home directory shared with a different CPU needs TORCH_EXTENSIONS_DIR set
    per machine. Apple clang has no -fopenmp: the build fails there and callers fall back."""
    import platform

    from torch.utils.cpp_extension import load

    arch = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    # -fno-trapping-math: without it GCC keeps any loop with a float -> int conversion (the
    # kernels' exp) scalar, since the conversion could raise an FP exception nobody reads here.
    from pathlib import Path

    import hashlib

    shared = Path(__file__).parent / "csrc"  # cpu_math.h
    # torch's cache key hashes the sources and flags, not included headers: the header's hash
    # rides in a define so that editing it rebuilds both modules.
    tag = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(shared.glob("*.h")))).hexdigest()[:12]
    return load(name=name, sources=[source], extra_include_paths=[str(shared)],
                extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math", f"-DFLATSERVE_HEADERS={tag}", *arch],
                extra_ldflags=["-fopenmp"], verbose=False)


class CpuExtension:
    """A C++ extension built on the first call and returned from then on; None where the build
    failed (no compiler, ninja or headers), with the reason in `error`, logged once together with
    what runs instead (`fallback`)."""

    def __init__(self, name: str, source: str, fallback: str) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self.error: str | None = None
        self._built: list[ModuleType | None] = []

    def __call__(self) -> ModuleType | None:
        if not self._built:
            try:
                self._built.append(build_cpu_extension(self.name, self.source))
            except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                self._built.append(None)
                self.error = build_error(e)
                logging.getLogger(__name__).warning("%s unavailable (%s); %s", self.name, self.error,
                                                    self.fallback)
        return self._built[0]


def build_error(e: Exception) -> str:
    """The one line of a failed build worth logging."""
    lines = [x for x in str(e).splitlines() if "error" in x.lower()] or [repr(e)]
    return lines[-1].strip()[:300]


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R] with x.max(dim=-1).indices' rule. On the CPU through the fused
    ops' vector kernel where it built (16 x 262k bf16: see flatserve/ops/cpu_ops.py); elsewhere
    torch's reduction."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0:
        from flatserve.ops import cpu_ops

        if cpu_ops.available():
            return cpu_ops.argmax_rows(x)
    return x.max(dim=-1).indices


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "mps":
        return torch.float16
    # AVX2 + FMA without native bf16: the weights stay bf16 and widen in registers
    # (flatserve/model/avx2.py), half the bytes of fp32 per decode step.
    return torch.bfloat16 if cpu_has_fast_bf16() or cpu_has_avx2_fma() else torch.float32


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def supports_cuda_graphs(device: torch.device) -> bool:
    return device.type == "cuda"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without blocking the host: from pinned memory on CUDA (a copy
    from pageable memory may wait for the stream, which would undo async scheduling)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """Start a device->host copy; -> (host tensor, wait). CUDA: pinned buffer + event, so the
    host can keep working (async scheduling) until it needs the values."""
    if t.device.type != "cuda":
        return t, lambda: None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event.synchronize


def probe_memory(device: torch.device) -> MemoryProbe:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        return MemoryProbe(total, free, bool(getattr(props, "is_integrated", False)),
                           f"{device} ({props.name})")
    import psutil

    vm = psutil.virtual_memory()
    return MemoryProbe(vm.total, vm.available, True, device.type)


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host pages are mapped on first write (anonymous mmap) rather than
    filled up front, so a CPU process holds what it has used, not what it may use. The KV
    pool is the case: the default model's 15.7 GiB pool on a 24 GB box took 15 s of a 24 s
    start-up to zero and left 17.8 GB resident for a one-prompt `generate`. The budget still
    caps the pool; the kernel counts its pages as they are touched. GPUs: torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import math
    import mmap

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # MAP_PRIVATE: Python's default for -1 is MAP_SHARED, which is shmem. Shmem maps a real
    # page on a read of untouched memory and faults slower (1.3 against 1.05 us a 4 KB page,
    # this VM); private anonymous memory reads the shared zero page until written.
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer holds a reference to buf, so the mapping lives as long as the tensor.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def release_freed_memory(device: torch.device) -> None:
    """Hand freed heap pages back to the OS (glibc keeps them, and RSS with them, otherwise)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (macOS): nothing to trim


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_HEAP_BYTES = 1 << 30


def keep_freed_heap(device: torch.device) -> bool:
    """CPU on glibc: keep freed memory for the next step's transients instead of handing it
    back to the OS; -> whether the setting took. Call once start-up's own temporaries (weight
    conversion, the peak profile) have been handed back.

    Why: a step's large transients sit above glibc's mmap threshold (dynamic, 32 MB at most) or
    at the top of the heap, so free() returns them and the next step faults every 4 KB page in
    again. A verify step at 16 requests x 4 tokens has 55 x 262k bf16 logits (29 MB): ~7,000
    faults a step, which took the LM head to 54 ms against 20 without them
    (`benchmarks/cpu_profile_step.py 16 --by-kernel --ngram 3`, docs/benchmarks/cpu.md,
    session 10). The heap then holds about the
    largest step's transients, which the memory budget counts as peak activations; small
    allocations can split freed blocks, so it may settle somewhat above one step's worth. The
    CPU benchmark's peak RSS stayed within its run-to-run spread (2.17-2.23 GiB).
    The effect is process-wide, like the thread count; vLLM's CPU guide gets it by preloading
    tcmalloc."""
    if device.type != "cpu":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_HEAP_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_HEAP_BYTES))
    except (OSError, AttributeError):
        return False  # not glibc (macOS): its allocator is left as it is


def process_rss() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


class PeakTracker:
    """Peak memory over a region: the CUDA allocator's peak, or sampled process RSS growth."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakTracker:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._base = process_rss()
            self._max = self._base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, process_rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, process_rss()) - self._base
