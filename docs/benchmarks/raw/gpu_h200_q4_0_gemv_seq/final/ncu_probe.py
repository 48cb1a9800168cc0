import sys, torch
sys.path.insert(0, ".")
from benchmarks.dev.quant_gemm_gpu import random_blocks
from flatserve.model import cuda_gemv, quant_planar as qp
from flatserve.model.qformats import FORMATS
fmt, dev = FORMATS["q4_0"], torch.device("cuda")
assert cuda_gemv.prepare(dev)
for name, (n, k) in {"o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}.items():
    p = qp.repack(random_blocks(n, k, fmt, "cuda"), fmt)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    qp.qgemm(x, p, fmt, out)
    torch.cuda.synchronize()
    print(name, cuda_gemv.choose(n, k // 32, dev)[0], flush=True)
