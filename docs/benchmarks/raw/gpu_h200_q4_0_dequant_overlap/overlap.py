"""Feasibility: dequantize linear i+1 on a side stream while cuBLAS multiplies linear i, cuBLAS
held to fewer SMs (torch._C._set_sm_carveout_experimental). Llama-3-8B's four linears a layer at
ROWS rows, q4_0 planar; device us a layer (8 layers of weights rotated)."""
import sys
import torch
import triton
sys.path.insert(0, ".")
from benchmarks.dev.quant_gemm_gpu import random_blocks
from flatserve.model import quant_planar as qp
from flatserve.model.qformats import FORMATS

fmt = FORMATS["q4_0"]
dev = torch.device("cuda")
SH = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LAYERS = 6
ws = [[qp.repack(random_blocks(n, k, fmt, "cuda"), fmt) for n, k in SH] for _ in range(LAYERS)]
dense_bf16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in SH]
bufs = [torch.empty(28672 * 4096, dtype=torch.bfloat16, device=dev) for _ in range(2)]
side = torch.cuda.Stream()
sms = torch.cuda.get_device_properties(0).multi_processor_count


def deq(p, n, k, buf):
    codes, scales, nblk = qp._views(p, fmt)
    dense = buf[: n * k].view(n, k)
    kb = next(v for v in (8, 4, 2, 1) if nblk % v == 0)
    qp._dequant_kernel[(triton.cdiv(n, 64), nblk // kb)](codes, scales, dense, n, k, nblk, FMT=qp.FORMATS[fmt.name],
                                                         BLOCK_N=64, KB=kb)
    return dense


def run_serial(xs, outs):
    for L in range(LAYERS):
        for i, (n, k) in enumerate(SH):
            d = deq(ws[L][i], n, k, bufs[0])
            torch.mm(xs[i], d.t(), out=outs[i])


def run_bf16(xs, outs):
    for L in range(LAYERS):
        for i, (n, k) in enumerate(SH):
            torch.mm(xs[i], dense_bf16[i].t(), out=outs[i])


def run_overlap(xs, outs):
    seq = [(L, i) for L in range(LAYERS) for i in range(len(SH))]
    ev_done = [torch.cuda.Event() for _ in seq]   # dequant j finished (side)
    ev_used = [torch.cuda.Event() for _ in seq]   # mm j finished (main): its buffer free
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        deq(ws[0][0], *SH[0], bufs[0])
        ev_done[0].record(side)
    for j, (L, i) in enumerate(seq):
        if j + 1 < len(seq):
            L2, i2 = seq[j + 1]
            with torch.cuda.stream(side):
                if j >= 1:
                    side.wait_event(ev_used[j - 1])  # buffer (j + 1) % 2 was mm j - 1's
                deq(ws[L2][i2], *SH[i2], bufs[(j + 1) % 2])
                ev_done[j + 1].record(side)
        main.wait_event(ev_done[j])
        n, k = SH[i]
        torch.mm(xs[i], bufs[j % 2][: n * k].view(n, k).t(), out=outs[i])
        ev_used[j].record(main)
    main.wait_stream(side)


def timed(fn, rows, reps=5):
    xs = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for n, k in SH]
    outs = [torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for n, k in SH]
    fn(xs, outs)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(xs, outs); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / LAYERS)
    return min(ts)


print(torch.__version__, torch.cuda.get_device_name(), sms, "SMs")
for rows in (256, 512):
    res = {"bf16": timed(run_bf16, rows), "serial": timed(run_serial, rows)}
    for co in (0, 8, 16, 24, 32, 48):
        torch._C._set_sm_carveout_experimental(co or None)
        res[f"bf16 co{co}"] = timed(run_bf16, rows)
        res[f"overlap co{co}"] = timed(run_overlap, rows)
    torch._C._set_sm_carveout_experimental(None)
    print(f"rows {rows}: " + "  ".join(f"{k} {v:.0f}" for k, v in res.items()), flush=True)
# correctness of the overlap schedule (same outputs as serial)
xs = [torch.randn(64, k, device=dev, dtype=torch.bfloat16) for n, k in SH]
o1 = [torch.empty(64, n, device=dev, dtype=torch.bfloat16) for n, k in SH]
o2 = [torch.empty(64, n, device=dev, dtype=torch.bfloat16) for n, k in SH]
run_serial(xs, o1); run_overlap(xs, o2); torch.cuda.synchronize()
print("same outputs:", all(torch.equal(a, b) for a, b in zip(o1, o2)))
