"""What more than one benchmark script uses; scripts import this module, never each other.

- timing: wall-clock ms per call for the CPU micro-benchmarks (`ms_per_call`), median GPU ms by
  CUDA events (`gpu_ms`);
- workloads: the seeded mixed-length prompts of offline_cpu.py (`make_prompts`), the GPU
  attention cases of attention_kernels.py (`CASES`, `rotated_run`), a paged copy of one
  sequence's K/V for the CPU prefill kernels (`paged`);
- this machine: the CPU's ISA level as the reports name it (`isa`);
- A/B builds: a C++ kernel source as it is at a git revision beside the working tree's
  (`build_at_rev`, `ab_modules`), for the scripts in benchmarks/dev/.

Heavy imports (flatserve's kernels, Triton) happen inside the functions that need them.
"""
from __future__ import annotations

import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch


def ms_per_call(fn: Callable[[], object], n: int = 10, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


# ~0.5 ms of GPU spin (torch.cuda._sleep counts cycles): long enough for the host to queue the
# timed call behind it, so host launch overhead never shows up between the events.
SLEEP_CYCLES = 1_000_000


def gpu_ms(fn: Callable[[], object], timer: str = "events", warmup: int = 20, reps: int = 100) -> float:
    """Median ms of fn on the GPU.

    timer "do_bench": triton.testing.do_bench, which zeroes a 256 MB buffer before every call.
    That memset leaves the L2 full of dirty lines, and the timed kernel pays for writing them
    back: +8 us on a 130-260 us decode (benchmarks/dev/decode_flush.py). timer "events": CUDA events
    around each call, with a GPU spin (no memory traffic) before it instead of the memset. Callers
    rotate their inputs over copies larger than L2, so data is still read from HBM each call."""
    import statistics

    if timer == "do_bench":
        import triton

        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for a, b in pairs:
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


# --- workloads -------------------------------------------------------------------------------

WORDS = ("the of and a to in is you that it he was for on are as with his they at be this "
         "from have or by one had not but what all were when we there can an your which their").split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths 10..1,500 tokens (about one token per word for this vocabulary)."""
    rng = random.Random(seed)
    lens = [10, 1500] + [rng.randint(10, 1500) for _ in range(max(0, n - 2))]
    return [" ".join(rng.choice(WORDS) for _ in range(L)) for L in lens[:n]]


# The GPU attention cases of attention_kernels.py: name, q_lens, seq_lens, hq, hkv.
CASES = [
    ("decode 64 x 2048", [1] * 64, [2048] * 64, 32, 8),
    ("decode 256 x 1024", [1] * 256, [1024] * 256, 32, 8),
    ("decode 8 x 8192", [1] * 8, [8192] * 8, 32, 8),
    ("verify 4 tok x 32 x 2048", [4] * 32, [2048] * 32, 32, 8),
    ("prefill 1 x 2048", [2048], [2048], 32, 8),
    ("chunk 512 @ 4096 + 63 decodes", [512] + [1] * 63, [4096] + [2048] * 63, 32, 8),
    ("16/4: decode 64 x 128", [1] * 64, [128] * 64, 16, 4),
    ("16/4: decode 256 x 128", [1] * 256, [128] * 256, 16, 4),
    ("16/4: decode 1024 x 128", [1] * 1024, [128] * 1024, 16, 4),
    ("16/4: decode 64 x 2048", [1] * 64, [2048] * 64, 16, 4),
    ("16/4: decode 256 x 2048", [1] * 256, [2048] * 256, 16, 4),
    ("16/4: decode 1024 x 2048", [1] * 1024, [2048] * 1024, 16, 4),
    ("16/4: prefill 8 x 512", [512] * 8, [512] * 8, 16, 4),
    ("16/4: mixed 32 decodes + 4 x 512", [1] * 32 + [512] * 4, [2048] * 32 + [512] * 4, 16, 4),
]
D, BS, DT = 128, 16, torch.bfloat16  # head size, KV block size, dtype of those cases


def rotated_run(sets: list, p: object, **kw: object) -> Callable[[], None]:
    """unified_attention on the next of `sets` at each call: inputs rotate, so L2 holds none.
    `p`: the layer's LayerAttnParams."""
    from flatserve.attention.kernels.unified_attention import unified_attention

    outs = [torch.empty_like(s[0]) for s in sets]
    i = [0]

    def run() -> None:
        k = i[0] = (i[0] + 1) % len(sets)
        q, kc, vc, meta = sets[k]
        unified_attention(q, kc, vc, meta, p, out=outs[k], **kw)

    return run


def paged(k: torch.Tensor, v: torch.Tensor, bs: int = 16) -> tuple[torch.Tensor, ...]:
    """k/v [L, Hkv, D] -> caches [N, bs, Hkv, D] in shuffled blocks, block table [1, nb]."""
    L, hkv, d = k.shape
    nb = -(-L // bs)
    ids = torch.randperm(nb) + 1
    kc = torch.zeros(nb + 1, bs, hkv, d, dtype=k.dtype)
    vc = torch.zeros_like(kc)
    pad = nb * bs - L
    kc[ids] = torch.cat([k, k.new_zeros(pad, hkv, d)]).view(nb, bs, hkv, d)
    vc[ids] = torch.cat([v, v.new_zeros(pad, hkv, d)]).view(nb, bs, hkv, d)
    return kc, vc, ids.to(torch.int32)[None]


# --- this machine ----------------------------------------------------------------------------

def isa() -> str:
    """The CPU's best ISA level, named as the reports name it (avx2+fma+f16c, amx, ...)."""
    from flatserve import device as dev

    flags = dev._cpu_flags()
    levels = [("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"),
              ("avx2+fma+f16c", "avx2")]
    return next((name for name, f in levels if f in flags), "portable")


# --- A/B builds of a C++ kernel ----------------------------------------------------------------

def build_at_rev(src: str, rev: str, prefix: str) -> object:
    """The C++ source `src` as it is at git revision `rev`, built under its own module name with
    the shared headers (flatserve/csrc) as they are at `rev`: they are written beside the
    source, where its quoted includes look first."""
    from flatserve import kernels

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    tmp = Path(tempfile.mkdtemp())
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "flatserve/csrc/"], check=True,
                           capture_output=True, text=True).stdout.split()
    files = {Path(p).name: show(p) for p in [*names, src] if p == src or p.endswith(".h")}
    for name, text in files.items():
        (tmp / name).write_text(text)
    tag = abs(hash("".join(files.values()))) % 10**8
    return kernels.build_module(f"{prefix}_{tag}", tmp / Path(src).name)


def ab_modules(src: str, rev: str, prefix: str, name: str) -> dict[str, object]:
    """{rev: the source at `rev`, "working tree": the module as the engine builds it (`name`)}."""
    from flatserve import device as dev
    from flatserve import kernels

    level = dev.cpu_isa()
    return {rev: build_at_rev(src, rev, prefix),
            "working tree": kernels.build_module(f"{name}_{level}", src, level)}
