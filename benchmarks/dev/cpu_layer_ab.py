"""Gemma 3 270M's prompt-step linears with the norms between them, 18 layers, the AMX GEMM at a
git revision against the working tree's, alternated in one process (this box drifts +-10-25%
between runs; median and min of --rounds).

    .venv/bin/python benchmarks/dev/cpu_layer_ab.py [--rev HEAD] [--rows 2048] [--rounds 10]

Per layer: qkv (1,536 x 640), o (640 x 1,024) on a copy of q standing in for attention's output,
the post-attention norm pair, the gated gate_up (4,096 x 640, GELU-tanh), down (640 x 2,048) and
the next norm pair; each layer its own random weights, as an engine step streams them. Unlike
cpu_gemm_ab.py, the inputs come from the previous op, so a kernel's effect on the caches the
next op reads (which core holds which rows) counts too. The outputs must agree bit for bit.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.common import ab_modules  # noqa: E402
from flatserve import device as dev  # noqa: E402
from flatserve.model.amx import AMXLinear  # noqa: E402
from flatserve.ops import cpu_ops  # noqa: E402

SRC = "flatserve/ops/csrc/amx_gemm_cpu.cpp"  # the AMX GEMM kernel, as in cpu_gemm_ab.py

EMPTY = torch.empty(0, dtype=torch.bfloat16)
GELU = 2  # the kernel's activation code for gelu-tanh


def packed(n: int, k: int) -> torch.Tensor:
    return AMXLinear(torch.randn(n, k, dtype=torch.bfloat16) * 0.05, None).packed


def step(m: object, layers: list, x0: torch.Tensor) -> torch.Tensor:
    rows = x0.shape[0]
    res = x0.clone()  # [T, 640] residual stream
    h = cpu_ops.rms_norm(res, layers[0][4], 1e-6, True)
    for wqkv, wo, wgu, wd, nw in layers:
        qkv = m.linear(h, wqkv, EMPTY, 0)  # [T, 1536]
        o = m.linear(qkv[:, :1024].contiguous().view(rows, 1024), wo, EMPTY, 0)  # [T, 640]
        h = cpu_ops.rms_norm_pair(o, nw, nw, 1e-6, True, res)
        g = m.linear(h, wgu, EMPTY, GELU)  # [T, 2048]
        d = m.linear(g, wd, EMPTY, 0)  # [T, 640]
        h = cpu_ops.rms_norm_pair(d, nw, nw, 1e-6, True, res)
    return h


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    if not dev.cpu_has_amx_bf16() or not cpu_ops.available():
        sys.exit("needs a CPU with AMX bf16 and the fused CPU ops")
    dev.keep_freed_heap(torch.device("cpu"))  # as the engine runs: outputs not faulted in per call
    mods = ab_modules(SRC, a.rev, "flatserve_gemm_ab", "flatserve_amx_gemm")
    torch.manual_seed(0)
    layers = [(packed(1536, 640), packed(640, 1024), packed(4096, 640), packed(640, 2048),
               torch.randn(640, dtype=torch.bfloat16) * 0.1) for _ in range(18)]
    x0 = torch.randn(a.rows, 640, dtype=torch.bfloat16)
    outs = [step(m, layers, x0) for m in mods.values()]
    assert torch.equal(outs[0], outs[1]), "the two kernels disagree"
    times: dict[str, list[float]] = {name: [] for name in mods}
    names = list(mods)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            step(mods[name], layers, x0)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{a.rows} rows, 18 layers: " + ", ".join(
        f"{k} median {med[k]:.1f} ms (min {min(v) * 1e3:.1f})" for k, v in times.items())
        + f" ({med[a.rev] / med['working tree']:.2f}x)")


if __name__ == "__main__":
    main()
