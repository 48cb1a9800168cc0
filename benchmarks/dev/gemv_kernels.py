"""The one-row q4_0 GEMV's kernels (flatserve/model/cuda_gemv.py) per Llama-3-8B linear: the
default choice, then the FMA kernel at 1, 2 and 4 rows a warp and the tensor-core kernel at 2
and 4 steps a load group; device us a call in a CUDA graph with the weights rotated over 2x the
L2; floor = weight bytes / the copy rate measured here. With --fused: the default against the
forms flatserve/model/cuda_stack.py launches (q|k|v and the LM head with the RMSNorm inside,
gate|up with the norm and act(gate) * up, o and down with the residual add; o and down handing
the norm on with norm_out, q|k|v and gate|up taking it prenormed).

    PYTHONPATH=. python3 benchmarks/dev/gemv_kernels.py [--rounds 2] [--fused]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
# cuda_gemv settings: the default, the kernels before q4_ks (their default, the FMA kernel forced
# to 1 / 2 / 4 rows, the mma kernel's load groups: it runs only where rows_per_warp says 4), then
# q4_ks at any row count (K <= 4,096 only), with fp32 products, the default without q4_ksx (the FMA
# kernel there) and the default with fp32 products
OLD = {"KS": False, "KSX": False}
SETTINGS = [{}, OLD, {**OLD, "MMA": False, "FMA_ROWS": 1}, {**OLD, "MMA": False, "FMA_ROWS": 2},
            {**OLD, "MMA": False, "FMA_ROWS": 4}, {**OLD, "STEPS": 2}, {**OLD, "STEPS": 4}] + \
    [{"KS_ALL": True}, {"KS_ALL": True, "H2": ""}, {"KSX": False}, {"H2": ""}]
BASE = {"MMA": True, "FMA_ROWS": None, "STEPS": None, "KS": True, "KS_ALL": False, "H2": "_h2",
        "H2_ROWS": True, "KSX": True}


def main() -> None:
    import torch

    from benchmarks.dev.quant_gemm_gpu import graph_us, random_blocks
    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import cuda_gemv, quant_planar as qp
    from flatserve.model.qformats import FORMATS

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fused", action="store_true", help="the decoder stack's forms against the default")
    args = ap.parse_args()
    fmt, dev = FORMATS["q4_0"], torch.device("cuda")
    assert cuda_gemv.prepare(dev)
    bw, l2 = copy_bandwidth(), torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(), f"copy {bw / 1e9:.0f} GB/s", flush=True)
    for name, (n, k) in SHAPES.items():
        nbytes = n * fmt.row_bytes(k)
        ps = [qp.repack(random_blocks(n, k, fmt, "cuda"), fmt) for _ in range(max(1, -(-2 * l2 // nbytes)))]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        res: dict = {}
        plain = [lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps]  # the default path, one call a copy
        if args.fused:
            codes, scales, nblk = zip(*[qp._views(p, fmt) for p in ps])
            w, r = torch.ones(k, dtype=torch.bfloat16, device=dev), torch.randn_like(out)
            nw, hw = torch.ones(n, dtype=torch.bfloat16, device=dev), torch.empty_like(out)
            # prenormed's partials: as o's and down's hand-offs write them (the stack's one count)
            given = torch.ones(cuda_gemv.handoff_parts(k, dev, SHAPES["o"][1] // 32, SHAPES["down"][1] // 32),
                               device=dev)
            pre = {"prenormed": (given, 1e-5)}
            forms = {"qkv": [{"norm": (w, 1e-5)}, pre], "head": [{"norm": (w, 1e-5)}],
                     "o": [{"res": r}, {"res": r, "norm_out": None}],
                     "down": [{"res": r}, {"res": r, "norm_out": None}],
                     "gate_up": [{"norm": (w, 1e-5), "act": "silu"}, {**pre, "act": "silu"}]}[name]
            for _ in range(args.rounds):
                res.setdefault("default", []).append(graph_us(plain))
                for form in forms:
                    y = out[:, :n // 2] if "act" in form else out
                    fused = [lambda i=i, y=y, form=form: cuda_gemv.gemv(x, codes[i], scales[i], y, n, nblk[i],
                                                                        **form) for i in range(len(ps))]
                    # packed-fp16 products, then fp32 ones; o and down by q4_ksx, then the FMA kernel
                    runs = (("_h2", True), ("", True)) + ((("_h2", False),) if name in ("o", "down") else ())
                    for h2, ksx in runs:
                        cuda_gemv.H2, cuda_gemv.KSX = h2, ksx
                        mine = torch.zeros(max(1, cuda_gemv.handoff_parts(n, dev, nblk[0])), device=dev)
                        if "norm_out" in form:
                            form["norm_out"] = (nw, hw, mine)
                        res.setdefault("+".join(form) + ("" if h2 else " fp32") + ("" if ksx else " fma"),
                                       []).append(graph_us(fused))
                    cuda_gemv.H2, cuda_gemv.KSX = BASE["H2"], BASE["KSX"]
        else:
            for _ in range(args.rounds):
                for st in SETTINGS:
                    for a, v in {**BASE, **st}.items():
                        setattr(cuda_gemv, a, v)
                    key = cuda_gemv.choose(n, k // 32, dev)[0]
                    prefix = {0: "default ", 1: "before ", len(SETTINGS) - 2: "no-ksx ",
                              len(SETTINGS) - 1: "default "}
                    label = (prefix.get(SETTINGS.index(st), "")
                             + "/".join(map(str, key)) + (" fp32" if st.get("H2") == "" else ""))
                    res.setdefault(label, []).append(graph_us(plain))
        for a, v in BASE.items():
            setattr(cuda_gemv, a, v)
        if not args.fused and k <= 4096:  # q4_ks's packed-fp16 products against its fp32 ones
            cuda_gemv.KS_ALL, cuda_gemv.H2 = True, ""
            plain[0]()
            ref = out.clone()
            cuda_gemv.H2 = "_h2"
            plain[0]()
            d = (out.float() - ref.float()).abs()
            print(f"  {name}: fp16 products against fp32: bf16 outputs differing {(d > 0).float().mean().item():.3f}"
                  f", max |d| / max |out| {d.max().item() / ref.float().abs().max().item():.2e}", flush=True)
            for a, v in BASE.items():
                setattr(cuda_gemv, a, v)
        print(f"{name:8s} floor {nbytes / bw * 1e6:6.1f} us  "
              + "  ".join(f"{key}: {min(v):6.1f}" for key, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
