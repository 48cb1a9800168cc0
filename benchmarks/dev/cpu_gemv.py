"""One-row and 16-row GEMM speed on this CPU per weight format (Gemma 3 270M shapes): bf16 and fp32
`F.linear`, bf16 on oneDNN's pre-packed weight (`onednn`, flatserve/model/onednn.py),
bf16 on our AMX kernel (`amx`, flatserve/model/amx.py, where the CPU has AMX),
`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`. The evidence for
`--cpu-gemm` and `--quantization int8` (flatserve/model/quant.py); ms per call (median), and the
effective GB/s of the bf16 paths. Rows: 1 and 16 (decode), 64 (16 verify runs of 4), 512 and
2,048 (prefill chunks).

    .venv/bin/python benchmarks/dev/cpu_gemv.py
"""
import sys, time
sys.path.insert(0, ".")
import torch
torch.manual_seed(0)
def bench(f, n=20):  # median ms: this 2-core box's timings swing, the median less so
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3
from flatserve.model import amx
from flatserve.model.onednn import OneDNNLinear
HAS_AMX = amx.available(torch.bfloat16)
for N, K in [(262144, 640), (2048*2, 640), (640, 2048), (1536, 640), (640, 1024)]:
    W = torch.randn(N, K, dtype=torch.bfloat16)
    for M in (1, 16, 64) if N > 100_000 else (1, 16, 64, 512, 2048):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        r = {"bf16": bench(lambda: torch.nn.functional.linear(x, W))}
        lin = OneDNNLinear(W, None)
        r["onednn"] = bench(lambda: lin(x))
        if HAS_AMX:
            lin_amx = amx.AMXLinear(W, None)
            r["amx"] = bench(lambda: lin_amx(x))
        gbs = {k: round(N * K * 2 / v / 1e6, 1) for k, v in r.items()}
        if M > 16:  # the other formats are decode alternatives
            print(N, K, M, {k: round(v, 3) for k, v in r.items()}, "GB/s", gbs)
            continue
        Wf = W.float(); xf = x.float()
        r["fp32"] = bench(lambda: torch.nn.functional.linear(xf, Wf))
        s = W.float().abs().amax(1) / 127
        W8 = (W.float() / s[:, None]).round().to(torch.int8)
        r["int8pack"] = bench(lambda: torch._weight_int8pack_mm(x, W8, s.to(torch.bfloat16)))
        try:
            gs = 32
            Wi = torch.randint(0, 16, (N, K), dtype=torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(Wi, 1)
            sz = torch.randn(K // gs, N, 2, dtype=torch.bfloat16)
            r["int4pack"] = bench(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, gs, sz))
        except Exception as e:
            r["int4pack"] = str(e)[:80]
        print(N, K, M, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, "GB/s", gbs)
