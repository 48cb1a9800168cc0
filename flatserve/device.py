"""Every hardware difference in one place: device choice, dtype choice, sync, memory probes."""
from __future__ import annotations

import functools
import os
import threading
import time
from typing import Callable, Iterable

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
    """This CPU's feature flags from /proc/cpuinfo (Linux); empty elsewhere. Read once: the
    quantized linears ask per call."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(f.read().split())
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls beat fp32. Without them bf16 is emulated and slower.
    False where FLATSERVE_CPU_ISA forces avx2 or portable: a forced run then takes the paths such
    a CPU takes (the avx2 linears, fp32 prompt GEMMs), not oneDNN's native-bf16 ones."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags()) and cpu_isa() in ("amx", "avx512")


def cpu_has_amx_bf16() -> bool:
    """AMX bf16 tiles (Sapphire Rapids and later): flatserve/model/amx.py's kernel; False where
    FLATSERVE_CPU_ISA forces a lower level."""
    return "amx_bf16" in _cpu_flags() and cpu_isa() == "amx"


def cpu_has_avx2_fma() -> bool:
    """AVX2 + FMA + F16C (Haswell / Zen 1 and later): flatserve/model/avx2.py's kernel."""
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


# The C++ kernels' ISA levels, best first (flatserve/kernel_build.py has their compiler flags);
# each needs the /proc/cpuinfo flags of the avx2 level and its own. avxvnni is AVX2 with the
# VEX-encoded VNNI dot products (Intel Alder Lake and later client cores, AMD Zen 5): not a subset
# of avx512 (Zen 4 has AVX512-VNNI, not AVX-VNNI), so a kernel with no build of its own there runs
# its avx2 build (SERVED_BY).
ISA_LEVELS = ("amx", "avx512", "avxvnni", "avx2", "portable")
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
_ISA_NEEDS = {"amx": _AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}, "avx512": _AVX512,
              "avxvnni": _AVX2 | {"avx_vnni"}, "avx2": _AVX2, "portable": frozenset()}
SERVED_BY = {"avxvnni": "avx2"}  # a level -> the level whose build serves kernels that have none there
AVX2_LEVELS = ("avxvnni", "avx2")  # 256-bit vectors only: the kernels' AVX2 code paths


@functools.cache
def cpu_isa_levels() -> tuple[str, ...]:
    """The ISA levels this CPU can run, best first; portable only off x86-64 (and where
    /proc/cpuinfo cannot be read)."""
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return tuple(lv for lv in ISA_LEVELS if lv == "portable" or (x86 and _ISA_NEEDS[lv] <= _cpu_flags()))


def cpu_isa() -> str:
    """The ISA level the C++ kernels run at: the best this CPU runs, or FLATSERVE_CPU_ISA (read
    at each call, so a test can force a level) where set; a level the CPU cannot run is refused."""
    want = os.environ.get("FLATSERVE_CPU_ISA", "").strip().lower()
    levels = cpu_isa_levels()
    if not want or want == "auto":
        return levels[0]
    if want not in ISA_LEVELS:
        raise ValueError(f"FLATSERVE_CPU_ISA={want!r}: choose one of auto, {', '.join(ISA_LEVELS)}")
    if want not in levels:
        raise ValueError(f"FLATSERVE_CPU_ISA={want!r}: this CPU runs only {', '.join(levels)} "
                         f"(missing flags: {' '.join(sorted(_ISA_NEEDS[want] - _cpu_flags()))})")
    return want


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA and on every x86-64 CPU, fp16 on MPS; other CPUs bf16 only where
    they compute it natively.

    x86-64 without native bf16 (AVX2): the weights and KV cache stay bf16 (half the bytes a
    decode step reads: 0.5 against 1.0 GiB for Gemma 3 270M) and are widened to fp32 in
    registers (a 16-bit shift). Measured not slower than fp32 there: torch's bf16 linears at the
    default model's shapes took 0.59x fp32's time at 1 row and 0.97x at 16
    (benchmarks/dev/cpu_dtype_ab.py, AVX2 AMD EPYC, 2 cores, 2026-11-25)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "mps":
        return torch.float16
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return torch.bfloat16 if x86 or cpu_has_fast_bf16() else torch.float32


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def supports_cuda_graphs(device: torch.device) -> bool:
    return device.type == "cuda"


def programmatic_launch(device: torch.device) -> bool:
    """Whether the CUDA decode kernels launch with programmatic dependent launch (PDL): each
    starts while the one before it finishes, waits (griddepcontrol.wait) before reading what
    that one wrote, and a GEMV loads its first weights meanwhile (flatserve/ops/pdl.py). Hopper
    (sm_90) or later, a Triton that launches it, and FLATSERVE_PDL not "0" (the A/B)."""
    if device.type != "cuda" or os.environ.get("FLATSERVE_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pdl_capable(index)


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def cuda_hbm3e(device: torch.device) -> bool:
    """Whether a CUDA device is an H200 (HBM3e, ~4.1 TB/s copied against an H100's ~2.9): the
    quantized linears' dense-copy path is cheap enough there to take more rows
    (model/quant_planar.use_gemm, measured on both)."""
    if device.type != "cuda":
        return False
    return _hbm3e(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hbm3e(index: int) -> bool:
    return "H200" in torch.cuda.get_device_name(index)


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


_MADV_DONTNEED = 4  # Linux (asm-generic/mman-common.h)


def release_file_pages(live: Iterable[torch.Tensor]) -> int:
    """Unmap the pages of checkpoint-file mappings that no live tensor reads; -> bytes released.

    The loader adopts checkpoint tensors as views of one mmap of the file, which stays mapped as
    long as any of them lives (the default GGUF's embedding table). Every page it has faulted in
    stays resident with it, also where the tensor there was copied elsewhere and dropped: a fused
    linear's shards (q|k|v, gate|up) copied into one buffer, or the blocks the CPU decoder stack
    packs into one tensor. For the default GGUF that was 65 MB of layer weights held twice
    (benchmarks/dev/cpu_rss.py, 2026-11-27). Only mappings of a file that hold one of `live`
    are touched, and only their pages with no byte of a `live` tensor on them: nothing read is
    dropped, and such a page read again would be faulted in from the file (same bytes)."""
    if not hasattr(os, "sysconf"):
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in live if t.device.type == "cpu" and t.numel())
    try:
        with open("/proc/self/maps") as f:
            maps = [m for m in map(_file_mapping, f) if m is not None]
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return 0  # not Linux/glibc: the pages stay mapped
    freed = 0
    for a, b in maps:
        inside = [(lo, hi) for lo, hi in spans if a <= lo < b]
        if not inside:
            continue
        cur = a  # page-aligned start of the next gap
        for lo, hi in inside + [(b, b)]:
            end = lo // page * page  # the gap's pages end where a live tensor's first page starts
            if end > cur and libc.madvise(cur, end - cur, _MADV_DONTNEED) == 0:
                freed += end - cur
            cur = max(cur, -(-hi // page) * page)
    return freed


def _file_mapping(line: str) -> tuple[int, int] | None:
    """A /proc/self/maps line -> (start, end) if it maps a file (inode set, a path), else None."""
    f = line.split()
    if len(f) < 6 or f[4] == "0" or not f[5].startswith("/"):
        return None
    a, b = (int(x, 16) for x in f[0].split("-"))
    return a, b


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_HEAP_BYTES = 1 << 30
_STARTUP_MMAP_BYTES = 1 << 20


def map_large_allocations(device: torch.device) -> bool:
    """CPU on glibc, for start-up until keep_freed_heap: every allocation of 1 MiB or more gets
    a mapping of its own, so the heap holds only small objects; -> whether the setting took.

    Why: loading puts large tensors that live (weights, packed layouts, the greedy head's copy)
    and large ones that die (the checkpoint's dtype conversions, the weights a packed layout
    replaces, the peak profile's steps) side by side in the heap. The dead ones leave holes
    between the living, given back to the OS (release_freed_memory) but kept in the heap's
    span; once keep_freed_heap has stopped trimming, the steps' transients land in those holes
    here and there, and every hole they touch stays resident. With bf16 weights that was 142 MiB
    of free heap resident after 16 streams of 256 + 64 tokens; with the
    large ones mapped apart it was 43 MiB and the run's peak RSS 1,329 -> 1,231 MiB
    (benchmarks/dev/cpu_rss.py --dequantize, 2-core Xeon AMX, 2026-11-27). Setting the
    threshold turns off glibc's dynamic one (which rises to each freed mapping's size, up to 32
    MiB, so a 5 MiB weight freed at load sent the next 5 MiB weights to the heap); start-up's
    own steps then fault their transients in each time, which only the profile's two steps do."""
    if device.type != "cpu":
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, _STARTUP_MMAP_BYTES))
    except (OSError, AttributeError):
        return False  # not glibc (macOS): its allocator is left as it is


def keep_freed_heap(device: torch.device) -> bool:
    """CPU on glibc: keep freed memory for the next step's transients instead of handing it
    back to the OS; -> whether the setting took. Call once start-up's own temporaries (weight
    conversion, the peak profile) have been handed back.

    Why: a step's large transients sit above glibc's mmap threshold (dynamic, 32 MB at most) or
    at the top of the heap, so free() returns them and the next step faults every 4 KB page in
    again. A verify step at 16 requests x 4 tokens has 55 x 262k bf16 logits (29 MB): ~7,000
    faults a step, which took the LM head to 54 ms against 20 without them
    (`benchmarks/dev/cpu_profile_step.py 16 --by-kernel --ngram 3`; the git history of
    docs/benchmarks/cpu.md). The heap then holds about the
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
