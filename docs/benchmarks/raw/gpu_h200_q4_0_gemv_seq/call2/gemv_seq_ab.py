"""The one-row q4_0 GEMV (flatserve/model/cuda_gemv.py): the register and tensor-core kernels
against the row-sequential ones (q4_gemvs_*: a lane a block, each warp load 512 contiguous bytes
of one row) at 1, 2 and 4 rows a warp, per Llama-3-8B linear: device us a call in a CUDA graph
with the weights rotated over 2x the L2; floor = weight bytes / the copy rate measured here.
Each setting's output is compared with the register kernel's (a different fp32 summation order:
the largest difference, in bf16 ulps of the largest output, is printed when over 1).

    PYTHONPATH=. python3 benchmarks/dev/gemv_seq_ab.py [--rounds 2] [--seqs 4,2:4,1:8,1:2,2]
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
    ap.add_argument("--seqs", default="4,2:4,1:8,1:2,2", help="(rows a warp, steps a group) : ...")
    args = ap.parse_args()
    # (SEQ, MMA_ROWS): the register FMA kernel + 4-row mma, then each row-sequential kernel, then
    # the 8-row mma
    settings = [(None, 4)] + [(tuple(int(v) for v in t.split(",")), 4) for t in args.seqs.split(":")]
    settings += [(None, 8)]
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
        notes = []
        for _ in range(args.rounds):
            for seq, mrows in settings:
                cuda_gemv.SEQ, cuda_gemv.MMA_ROWS = seq, mrows
                res.setdefault((seq, mrows), []).append(
                    graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps]))
                qp.qgemm(x, ps[0], fmt, out)
                if ref is None:
                    ref = out.clone()
                else:
                    ulp = (out.float() - ref.float()).abs().max() / ref.float().abs().max() * 256
                    if ulp > 1:
                        notes.append(f"{seq} {mrows}: {ulp.item():.2f} ulps of the largest output apart")
        keys = []
        for seq, mrows in settings:
            cuda_gemv.SEQ, cuda_gemv.MMA_ROWS = seq, mrows
            keys.append(cuda_gemv.choose(n, k // 32, dev)[0])
        cuda_gemv.SEQ, cuda_gemv.MMA_ROWS = None, 4
        print(f"{name:8s} floor {nbytes / bw * 1e6:6.1f} us  " + "  ".join(
            f"{'/'.join(map(str, key))}: {min(v):6.1f}" for key, v in zip(keys, res.values())), flush=True)
        # (a setting that leaves this shape's kernel as it was prints the same key twice)
        for note in sorted(set(notes)):
            print("   ", name, note, flush=True)


if __name__ == "__main__":
    main()
