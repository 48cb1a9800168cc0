import sys
import torch
sys.path.insert(0, ".")
from benchmarks.dev.quant_gemm_gpu import graph_us, random_blocks
from flatserve.bench.gpu import copy_bandwidth
from flatserve.model import cuda_gemv, quant_planar as qp
from flatserve.model.qformats import FORMATS

fmt = FORMATS["q4_0"]
assert cuda_gemv.prepare(torch.device("cuda"))
bw = copy_bandwidth()
l2 = torch.cuda.get_device_properties(0).L2_cache_size
print(torch.cuda.get_device_name(), f"copy {bw/1e9:.0f} GB/s")
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "head": (128256, 4096)}
for name, (n, k) in shapes.items():
    nbytes = n * fmt.row_bytes(k)
    ps = [qp.repack(random_blocks(n, k, fmt, "cuda"), fmt) for _ in range(max(1, -(-2 * l2 // nbytes)))]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    res, ref = {}, None
    for rnd in range(2):
        for pipe in (None, 2, 4):
            cuda_gemv.STEPS = pipe
            t = graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps])
            res.setdefault(pipe, []).append(t)
            qp.qgemm(x, ps[0], fmt, out)
            if ref is None:
                ref = out.clone()
            elif not torch.equal(out, ref):
                print(f"  {name} pipe {pipe}: output differs, max {(out.float() - ref.float()).abs().max().item()}")
    print(f"{name:8s} floor {nbytes / bw * 1e6:6.1f} us  " + "  ".join(f"p{k}: {min(v):6.1f}" for k, v in res.items()), flush=True)
