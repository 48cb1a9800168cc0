"""One-off: the fused q4_0 GEMM with x's tiles brought in by TMA (a host tensor descriptor), so
Triton's pipeliner keeps STAGES of them in flight (with plain pointer loads it issues x's load
synchronously each step: Triton 3.9's TTGIR of quant_planar._gemm_kernel for sm_90), the scales one step
ahead in registers; both operand orders: W as the dot's left operand (registers) or x as the left
(shared memory, W dequantized into shared memory as the right). Against bf16 cuBLAS, the
whole-weight dequantize + cuBLAS and _gemm_kernel's own tiles, at 256 and 512 rows (the offline
run's decode steps), Llama-3-8B's four linears, one CUDA graph of 24 calls a figure.

    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_tma.py
"""
from __future__ import annotations

import sys

import triton
import triton.language as tl

sys.path.insert(0, ".")

from flatserve.model.quant_planar import _values  # noqa: E402


@triton.jit
def _tma_gemm(x_desc, c_ptr, s_ptr, out_ptr, M, N, nblk, stride_om, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, KB: tl.constexpr, STAGES: tl.constexpr, W_LEFT: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % grid_m, pid // grid_m
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rnc = tl.minimum(rn, N - 1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cptr = c_ptr + (rnc * nblk * 4)[:, None] + tl.arange(0, KB * 4)[None, :]  # [BN, KB W] words
    sptr = s_ptr + (rnc * nblk)[:, None] + tl.arange(0, KB)[None, :]  # [BN, KB]
    if W_LEFT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    d = tl.load(sptr).to(tl.float32)
    for kb0 in tl.range(0, nblk, KB, num_stages=STAGES):
        v = tl.load(cptr + kb0 * 4)
        x = x_desc.load([pid_m * BLOCK_M, kb0 * 32])  # [BM, KB 32]
        d_next = tl.load(sptr + kb0 + KB, mask=kb0 + KB < nblk, other=0.0).to(tl.float32)
        w = tl.reshape(_values(tl.reshape(v, (BLOCK_N * KB, 4)), 1), (BLOCK_N, KB, 32))
        w = tl.reshape(w * d[:, :, None], (BLOCK_N, KB * 32)).to(tl.bfloat16)
        if W_LEFT:
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32)
        d = d_next
    if W_LEFT:
        mask = (rm < M)[None, :] & (rn < N)[:, None]
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(tl.bfloat16), mask=mask)
    else:
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(tl.bfloat16), mask=mask)


def main() -> None:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.dev.quant_gemm_gpu import SHAPES, copies, graph_us, random_blocks
    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    fmt = FORMATS["q4_0"]
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    for name, (n, k) in SHAPES.items():
        ps = copies(lambda: qp.repack(random_blocks(n, k, fmt, "cuda"), fmt), n * fmt.row_bytes(k))
        dn = copies(lambda: torch.randn(n, k, dtype=torch.bfloat16, device="cuda"), 2 * n * k)
        for m in (256, 512):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ref = torch.empty_like(out)
            qp.GEMM = False  # qgemm above 32 rows: dequantize + cuBLAS
            qp.qgemm(x, ps[0], fmt, ref)
            line = f"{name:8s} M={m} bf16 {graph_us([lambda d=d: torch.mm(x, d.t(), out=out) for d in dn]):7.1f}"
            line += f" deq+mm {graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps]):7.1f}"
            qp.GEMM = True
            line += f" fused {graph_us([lambda p=p: qp.gemm(x, p, fmt, out) for p in ps]):7.1f}"
            for bm, bn, kb, warps, st, left in ((128, 256, 2, 8, 3, False), (128, 128, 2, 8, 4, False),
                                                (256, 128, 2, 8, 3, True), (128, 128, 4, 8, 3, True),
                                                (64, 256, 2, 4, 4, False), (128, 256, 2, 8, 3, True)):
                desc = TensorDescriptor.from_tensor(x, [bm, kb * 32])
                grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

                def run(p, bm=bm, bn=bn, kb=kb, warps=warps, st=st, left=left, desc=desc, grid=grid):
                    c, s, nbk = qp._views(p, fmt)
                    _tma_gemm[grid](desc, c, s, out, m, n, nbk, out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                    KB=kb, STAGES=st, W_LEFT=left, num_warps=warps)
                tag = f"{bm}x{bn}x{kb}w{warps}s{st}{'L' if left else 'R'}"
                try:
                    out.zero_()
                    run(ps[0])
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    line += f" | {tag} {graph_us([lambda p=p: run(p) for p in ps]):7.1f} ({err:.0e})"
                except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit)
                    line += f" | {tag} {type(e).__name__}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
