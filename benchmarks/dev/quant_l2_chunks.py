"""q4_0 at 256-512 rows (the offline run's decode steps): dequantize + cuBLAS a chunk of weight
rows at a time into a scratch that stays in L2, against dequantizing the whole weight to HBM
(quant_planar's path above 256 rows), the fused GEMM (its best tile) and bf16 cuBLAS.

    PYTHONPATH=. python3 benchmarks/dev/quant_l2_chunks.py [--rows 256,512] [--chunk-mb 4,8,16]

At these rows bf16 cuBLAS is bound by arithmetic (gate_up at 512 rows ~750 TFLOP/s on an H100),
so the 4-bit weights cannot win there: the question is how close the dequantization comes to
free. Whole-weight dequantization writes and re-reads 2 bytes a value through HBM; a chunk of a
few MB written and read while it is still in L2 should cost only the 4-bit read. `--streams 2`
dequantizes chunk i + 1 on a second stream while cuBLAS runs chunk i (double-buffered scratch).
Device us per call in CUDA graphs, weights rotated over 2x the L2 (quant_gemm_gpu.graph_us).
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")


def main() -> None:
    import torch
    import triton

    from benchmarks.dev.quant_gemm_gpu import SHAPES, graph_us, random_blocks
    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,512")
    ap.add_argument("--chunk-mb", default="4,8,16")
    a = ap.parse_args()
    fmt = FORMATS["q4_0"]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}  L2 {l2 >> 20} MiB", flush=True)
    side = torch.cuda.Stream()

    def dequant(codes, scales, dst, n0, n1, k, nblk):
        kb = next(b for b in (8, 4, 2, 1) if nblk % b == 0)
        qp._dequant_kernel[(triton.cdiv(n1 - n0, 64), nblk // kb)](
            codes[n0:n1], scales[n0:n1], dst, n1 - n0, k, nblk, FMT=1, BLOCK_N=64, KB=kb)

    def chunked(x, p, out, rows, scratch, two):
        codes, scales, nblk = qp._views(p, fmt)
        n, k = p.shape[0], x.shape[1]
        if not two:
            for n0 in range(0, n, rows):
                n1 = min(n, n0 + rows)
                s = scratch[0][: n1 - n0]
                dequant(codes, scales, s, n0, n1, k, nblk)
                torch.mm(x, s.t(), out=out[:, n0:n1])
            return
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        evs = []
        for i, n0 in enumerate(range(0, n, rows)):
            n1 = min(n, n0 + rows)
            with torch.cuda.stream(side):
                if i >= 2:
                    side.wait_event(evs[i - 2][1])  # buffer i % 2 free once mm i - 2 is done
                dequant(codes, scales, scratch[i % 2][: n1 - n0], n0, n1, k, nblk)
                ready = torch.cuda.Event()
                ready.record(side)
            main_s.wait_event(ready)
            torch.mm(x, scratch[i % 2][: n1 - n0].t(), out=out[:, n0:n1])
            done = torch.cuda.Event()
            done.record(main_s)
            evs.append((ready, done))
        side.wait_stream(main_s)
        main_s.wait_stream(side)

    for name, (n, k) in SHAPES.items():
        nb = n * fmt.row_bytes(k)
        ps = [qp.repack(random_blocks(n, k, fmt, "cuda"), fmt) for _ in range(max(1, -(-2 * l2 // nb)))]
        copies = max(1, -(-l2 // (n * k)))  # 2 bytes a value: over 2x the L2
        denses = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        for m in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ref = torch.empty_like(out)
            t_bf = graph_us([lambda d=d: torch.mm(x, d.t(), out=out) for d in denses])
            qp.GEMM = False
            t_old = graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps])
            qp.qgemm(x, ps[0], fmt, ref)
            qp.GEMM = True
            line = (f"q4_0 {name:8s} M={m:4d} bf16 {t_bf:7.1f} | whole dequant {t_old:7.1f} "
                    f"({t_old / t_bf:4.2f}x)")
            try:
                t_g = graph_us([lambda p=p: qp.gemm(x, p, fmt, out, (256, 128, 2, 1, 8, 3)) for p in ps])
                line += f" | fused 256x128 {t_g:7.1f} ({t_g / t_bf:4.2f}x)"
            except Exception as e:  # noqa: BLE001
                line += f" | fused: {type(e).__name__}"
            for mb in [int(c) for c in a.chunk_mb.split(",")]:
                rows = max(64, (mb << 20) // (2 * k) // 64 * 64)
                scratch = [torch.empty(rows, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
                for two in (False, True):
                    t = graph_us([lambda p=p: chunked(x, p, out, rows, scratch, two) for p in ps])
                    chunked(x, ps[0], out, rows, scratch, two)
                    torch.cuda.synchronize()
                    err = (out.float() - ref.float()).abs().max().item()
                    note = "" if err == 0 else f" err {err:.1e}"
                    line += f" | {mb}MB{'x2' if two else ''} {t:7.1f} ({t / t_bf:4.2f}x{note})"
            print(line, flush=True)
        del ps, denses


if __name__ == "__main__":
    main()
