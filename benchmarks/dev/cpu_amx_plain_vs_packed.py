"""AMX bf16 GEMM at prompt sizes: torch's bf16 matmul, amx linear_plain (W read as stored),
amx linear on a packed W and the cost of packing, and torch fp32 (flatserve/model/quant.py,
_dense_rows: which AMX kernel a quantized linear's prompt rows take).

    .venv/bin/python benchmarks/dev/cpu_amx_plain_vs_packed.py    # needs a CPU with AMX
"""
import time

import torch
from flatserve.model import amx
ext = amx._ext()
torch.manual_seed(0)
def t(f, n=5):
    f(); s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e3
E=torch.empty(0,dtype=torch.bfloat16)
for M,K,N in [(2048,640,2048),(2048,2048,640),(2048,640,1024),(256,640,2048),(48,640,2048)]:
    x=torch.randn(M,K).bfloat16(); w=torch.randn(N,K).bfloat16(); p=amx._pack(w)
    a=t(lambda: x@w.t()); b=t(lambda: ext.linear_plain(x,w,E)); c=t(lambda: ext.linear(x,p,E,0)); d=t(lambda: amx._pack(w))
    xf=x.float(); wf=w.float(); e=t(lambda: xf@wf.t())
    full=ext.linear_plain(x,w,E); inv=all(torch.equal(ext.linear_plain(x[:m],w,E), full[:m]) for m in [1,5,13,17,33,48,100])
    print(M,K,N, f"torch bf16 {a:.2f} plain {b:.2f} packed {c:.2f} pack {d:.2f} fp32 {e:.2f} ms; plain row-inv {inv}; err {(full.float()-xf@wf.t()).abs().max():.3f}")
