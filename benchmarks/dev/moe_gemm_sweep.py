"""The fused MoE's two grouped GEMMs (flatserve/ops/fused_moe.py) over tile configurations, on a
CUDA device, at real expert shapes with random routing: ms and TFLOP/s per (BLOCK_M, BLOCK_N,
BLOCK_K, warps, stages), gate_up and down apart, and cuBLAS on one expert's dense GEMM of the
same size as the ceiling.

    python benchmarks/dev/moe_gemm_sweep.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--tokens 32768]
        [--configs "64,128,64,4,3 128,128,64,8,3"]

Runtime (estimate, not timed): ~2-4 s per configuration (one Triton compile each).
"""
from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, ".")
from flatserve.model.config import MoeConfig  # noqa: E402
from flatserve.ops import fused_moe as fm  # noqa: E402

SHAPES = {  # hidden, experts, top-k, expert intermediate size
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "gpt-oss-20b": (2880, 32, 4, 2880),
}
DEFAULT = ("64,64,64,4,3 64,128,64,4,3 64,128,64,8,3 64,128,64,4,4 64,256,64,8,3 "
           "128,128,64,8,3 128,128,64,8,4 128,128,32,8,4 128,64,64,4,3 128,256,64,8,3 "
           "64,128,128,4,3 128,128,128,8,3")


def _ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--configs", default=DEFAULT, help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages ...")
    a = ap.parse_args()
    H, E, k, I = SHAPES[a.shape]
    T, dev, dt = a.tokens, "cuda", torch.bfloat16
    moe = MoeConfig(num_experts=E, top_k=k, intermediate_size=I, sparse_layers=(True,))
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, generator=g, device=dev).to(dt)
    rw = (torch.randn(E, H, generator=g, device=dev) * 0.02).to(dt)
    wgu = (torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).to(dt)
    wd = (torch.randn(E, H, I, generator=g, device=dev) * 0.02).to(dt)
    w, ids = fm.route(x, rw, None, moe)
    flops_gu, flops_d = 2 * T * k * H * 2 * I, 2 * T * k * I * H
    per = T * k // E  # mean rows per expert
    dense_a, dense_b = torch.randn(per, H, device=dev, dtype=dt), torch.randn(2 * I, H, device=dev, dtype=dt)
    ms = _ms(lambda: dense_a @ dense_b.T) * E
    print(f"{a.shape}: T {T}, E {E}, top-{k}, H {H}, I {I}; cuBLAS, gate_up as {E} dense "
          f"[{per} x {H}] x [{H} x {2 * I}]: {ms:.2f} ms, {flops_gu / ms / 1e9:.0f} TFLOP/s")
    print(f"current GEMM_CFG {fm.GEMM_CFG}, block_m_for -> {fm.block_m_for(T * k, E)}")
    h = torch.empty(T * k, I, dtype=dt, device=dev)
    y = torch.empty(T * k, H, dtype=dt, device=dev)
    keep = dict(fm.GEMM_CFG)
    for c in a.configs.split():
        bm, bn, bk, warps, stages = (int(v) for v in c.split(","))
        fm.GEMM_CFG[bm] = (bn, bk, warps, stages)
        sorted_ids, block_e = fm.align_by_expert(ids, E, bm)
        try:
            t1 = _ms(lambda: fm.grouped_gemm(x, wgu, None, h, sorted_ids, block_e, bm, k, I,
                                             gated=True, moe=moe))
            t2 = _ms(lambda: fm.grouped_gemm(h, wd, None, y, sorted_ids, block_e, bm, 1, H,
                                             topw=w.view(-1)))
            print(f"  {c:>18}: gate_up {t1:7.2f} ms {flops_gu / t1 / 1e9:4.0f} TFLOP/s | "
                  f"down {t2:7.2f} ms {flops_d / t2 / 1e9:4.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001 - a config the compiler refuses (shared memory)
            print(f"  {c:>18}: failed: {str(e).splitlines()[0][:100]}", flush=True)
        fm.GEMM_CFG.clear()
        fm.GEMM_CFG.update(keep)
    ys = torch.randn(T * k, H, device=dev, dtype=dt)
    t_old = _ms(lambda: ys.view(T, k, H).sum(1))
    t_new = _ms(lambda: fm.sum_topk(ys, T, k, H))
    print(f"top-k sum: torch sum(1) {t_old:.2f} ms, sum_topk {t_new:.2f} ms; equal: "
          f"{torch.equal(ys.view(T, k, H).sum(1), fm.sum_topk(ys, T, k, H))}")


if __name__ == "__main__":
    main()
