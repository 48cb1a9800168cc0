"""One-off: quant_planar._gemm_kernel with Triton's automatic warp specialization on its K loop
(tl.range(..., warp_specialize=True)) against the kernel as it is and bf16 cuBLAS, q4_0 at 256 and
512 rows (the offline run's decode steps). Writes the variant to a temporary module.

    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_ws.py
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
import tempfile

sys.path.insert(0, ".")


def main() -> None:
    import torch
    import triton

    from benchmarks.dev.quant_gemm_gpu import SHAPES, copies, graph_us, random_blocks
    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    src = inspect.getsource(qp._gemm_kernel.fn)
    assert "num_stages=STAGES)" in src
    src = src.replace("num_stages=STAGES)", "num_stages=STAGES, warp_specialize=True)")
    mod = ("import triton\nimport triton.language as tl\n"
           "from flatserve.model.quant_planar import _values, _store_tile\n\n" + src)
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(mod)
    f.close()
    spec = importlib.util.spec_from_file_location("gemm_ws", f.name)
    ws = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ws)
    fmt = FORMATS["q4_0"]
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    for name, (n, k) in SHAPES.items():
        ps = copies(lambda: qp.repack(random_blocks(n, k, fmt, "cuda"), fmt), n * fmt.row_bytes(k))
        dn = copies(lambda: torch.randn(n, k, dtype=torch.bfloat16, device="cuda"), 2 * n * k)
        for m in (256, 512):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ref = torch.empty_like(out)
            t_bf = graph_us([lambda d=d: torch.mm(x, d.t(), out=out) for d in dn])
            line = f"{name:8s} M={m} bf16 {t_bf:7.1f}"
            for tiles in ((256, 128, 2, 1, 8, 3), (128, 128, 4, 1, 8, 3), (128, 256, 2, 1, 8, 3),
                          (256, 64, 2, 1, 4, 3), (128, 128, 4, 1, 4, 3)):
                bm, bn, kb, sp, warps, st = tiles
                codes, scales, nblk = qp._views(ps[0], fmt)
                grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), 1)

                def run(p, kern):
                    c, s, nb_ = qp._views(p, fmt)
                    kern[grid](x, c, s, out, out, m, n, nb_, x.stride(0), out.stride(0), nb_, FMT=1,
                               BLOCK_M=bm, BLOCK_N=bn, KB=kb, SPLITS=1, STAGES=st, num_warps=warps)
                try:
                    t0 = graph_us([lambda p=p: run(p, qp._gemm_kernel) for p in ps])
                    run(ps[0], qp._gemm_kernel)
                    ref.copy_(out)
                except Exception as e:  # noqa: BLE001
                    t0 = float("nan")
                    print(f"  plain {tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                try:
                    t1 = graph_us([lambda p=p: run(p, ws._gemm_kernel) for p in ps])
                    run(ps[0], ws._gemm_kernel)
                    torch.cuda.synchronize()
                    same = torch.equal(out, ref)
                except Exception as e:  # noqa: BLE001
                    t1, same = float("nan"), None
                    print(f"  ws {tiles}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                flag = " DIFF" if same is False else ""
                line += f" | {tiles[:3]}w{warps} {t0:6.1f} ws {t1:6.1f}{flag}"
            print(line, flush=True)
        del ps, dn


if __name__ == "__main__":
    main()
