"""The one-row q4_0 GEMV (flatserve/model/cuda_gemv.py): the register kernels against the ring
kernels (weights through a shared-memory ring fed by cp.async.bulk, sm_90), per Llama-3-8B
linear, device us a call in a CUDA graph with the weights rotated over 2x the L2; floor = weight
bytes / the device's copy rate measured here. Every setting's output is checked bit-equal to the
register kernel's (the same arithmetic in the same order).

    PYTHONPATH=. python3 benchmarks/dev/gemv_ring_ab.py [--rounds 2] [--rings 4,4:2,8:4,8]
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}


def main() -> None:
    import torch

    from benchmarks.dev.quant_gemm_gpu import graph_us, random_blocks
    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import cuda_gemv, quant_planar as qp
    from flatserve.model.qformats import FORMATS

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rings", default=":".join(f"{s},{p}" for s, p in cuda_gemv.RINGS))
    args = ap.parse_args()
    settings = [None] + [tuple(int(v) for v in r.split(",")) for r in args.rings.split(":")]
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
        ref = None
        for _ in range(args.rounds):
            for st in settings:
                cuda_gemv.RING = st
                res.setdefault(st, []).append(graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps]))
                qp.qgemm(x, ps[0], fmt, out)
                if ref is None:
                    ref = out.clone()
                elif not torch.equal(out, ref):
                    print(f"  {name} ring {st}: output differs from the register kernel's", flush=True)
        cuda_gemv.RING = None
        key = cuda_gemv.choose(n, k // 32, dev)[0]
        print(f"{name:8s} floor {nbytes / bw * 1e6:6.1f} us  " + "  ".join(
            f"{'reg' if st is None else '%d,%d' % st}: {min(v):6.1f}" for st, v in res.items())
            + f"   (reg: {key})", flush=True)


if __name__ == "__main__":
    main()
