"""Prototype: Llama-3-8B's four one-row q4_0 GEMVs a layer (q|k|v, o, gate|up, down), chained
over L layers, as one launch a GEMV (the engine's kernels, PDL on, in a CUDA graph) against one
persistent kernel with a grid barrier between phases (benchmarks/dev/layer_chain.cu). Only the
GEMVs (no norm, rope, attention, act): what not draining between linears is worth. Checks the
persistent kernel bit-equal to the FMA kernels' chain, then times each; floor = weight bytes /
the copy rate measured here.

    PYTHONPATH=. python3 benchmarks/dev/layer_chain.py [--layers 32] [--reps 20]

On an H200 (2026-11-29, raw docs/benchmarks/raw/gpu_h200_q4_0_gemv_ks/): 61.4 us a layer at its
best against 48.8 for the engine's kernels (floor 29.9). The GEMV phases themselves ran at about
the separate kernels' speed (median CTA 7.5 / 3.5 / 23.0 / 12.0 us); each barrier cost ~1.25 us,
staging x 0.5-1.75, and the slowest CTA 0.5-2.3 over the median, where PDL's hardware handover
between separate launches costs nearly nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, ".")

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
KERNELS = ["q4_chain_q2_r4_u1", "q4_chain_q4_r4_u1", "q4_chain_q2_r2_u1", "q4_chain_q2_r2_u2", "q4_chain_q2_r4_u2"]
_COOP = 2  # CU_LAUNCH_ATTRIBUTE_COOPERATIVE


def main() -> None:
    import torch

    from benchmarks.dev.quant_gemm_gpu import random_blocks
    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import cuda_gemv, quant_planar as qp
    from flatserve.model.qformats import FORMATS

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    fmt, dev = FORMATS["q4_0"], torch.device("cuda")
    assert cuda_gemv.prepare(dev)
    api = cuda_gemv._API
    root = Path(__file__).resolve().parents[2]
    src = (root / "flatserve/ops/csrc/q4_gemv_cuda.cu").read_bytes() + b"\n" + \
        (root / "benchmarks/dev/layer_chain.cu").read_bytes()
    major, minor = torch.cuda.get_device_capability()
    mod = ctypes.c_void_p()
    api.check(api.cuda.cuModuleLoadData(ctypes.byref(mod), api.compile(f"sm_{major}{minor}", src)), "load")
    funcs = {}
    for name in KERNELS:
        f = ctypes.c_void_p()
        api.check(api.cuda.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), name)
        api.check(api.cuda.cuFuncSetAttribute(f, 8, 64 * 1024), "max dynamic smem")  # MAX_DYNAMIC_SHARED
        funcs[name] = f
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), f"copy {bw / 1e9:.0f} GB/s, {sms} SMs", flush=True)

    L = args.layers
    ps = [[qp.repack(random_blocks(n, k, fmt, "cuda"), fmt) for n, k in SHAPES] for _ in range(L)]
    nbytes = sum(p.numel() for layer in ps for p in layer)
    for layer in ps:  # scales that keep x's magnitude through the chain: random codes have std 4.6
        for p, (n, k) in zip(layer, SHAPES):  # and mean -0.5, so a random sign a block
            sc = qp._views(p, fmt)[1]
            sign = torch.randint(0, 2, sc.shape, device=dev, dtype=torch.float16) * 2 - 1
            sc.copy_(sign / (4.6 * k ** 0.5))
    table = bytearray()
    for layer in ps:
        for p, (n, k) in zip(layer, SHAPES):
            codes, scales, nblk = qp._views(p, fmt)
            table += ctypes.c_uint64(codes.data_ptr()).value.to_bytes(8, "little")
            table += ctypes.c_uint64(scales.data_ptr()).value.to_bytes(8, "little")
            table += n.to_bytes(4, "little") + nblk.to_bytes(4, "little")
    tab = torch.frombuffer(table, dtype=torch.uint8).to(dev)
    x0 = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev) * 0.1
    x = torch.empty_like(x0)
    y0 = torch.empty(1, 6144, dtype=torch.bfloat16, device=dev)
    y1 = torch.empty(1, 4096, dtype=torch.bfloat16, device=dev)
    y2 = torch.empty(1, 28672, dtype=torch.bfloat16, device=dev)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)

    def engine_chain() -> None:
        for layer in ps:
            qp.qgemm(x, layer[0], fmt, y0)
            qp.qgemm(y0[:, :4096], layer[1], fmt, y1)
            qp.qgemm(y1, layer[2], fmt, y2)
            qp.qgemm(y2[:, :14336], layer[3], fmt, x)

    def persistent(name: str, mode: int = 0, ts: torch.Tensor | None = None):
        f = funcs[name]
        per = ctypes.c_int()
        smem = 14336 * 2
        api.check(api.cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(per), f, 128, ctypes.c_size_t(smem)), "occupancy")
        grid = per.value * sms

        def run() -> None:
            bar.zero_()
            a = [ctypes.c_void_p(tab.data_ptr()), ctypes.c_int(L), ctypes.c_void_p(x.data_ptr()),
                 ctypes.c_void_p(y0.data_ptr()), ctypes.c_void_p(y1.data_ptr()),
                 ctypes.c_void_p(y2.data_ptr()), ctypes.c_void_p(bar.data_ptr()),
                 ctypes.c_int(cuda_gemv._MAGIC), ctypes.c_int(mode),
                 ctypes.c_void_p(0 if ts is None else ts.data_ptr())]
            params = (ctypes.c_void_p * len(a))(*[ctypes.addressof(v) for v in a])
            attr = cuda_gemv._LaunchAttr(id=_COOP, value=1)
            cfg = cuda_gemv._LaunchConfig(grid=(ctypes.c_uint * 3)(grid, 1, 1),
                                          block=(ctypes.c_uint * 3)(128, 1, 1), smem=smem,
                                          stream=torch.cuda.current_stream().cuda_stream,
                                          attrs=ctypes.pointer(attr), num_attrs=1)
            api.check(api.cuda.cuLaunchKernelEx(ctypes.byref(cfg), f, params, None), name)
        return run, f"{per.value} CTAs/SM", grid

    def timeline(name: str, mode: int) -> str:
        """Per phase (q|k|v, o, gate|up, down; medians over layers 1..L-1), us: staging x, the
        GEMV (median CTA, slowest CTA), and from the slowest CTA's end to the median CTA's next
        phase start (the barrier as the grid sees it)."""
        grid = persistent(name)[2]
        ts = torch.zeros(L * 4, grid, 3, dtype=torch.int64, device=dev)
        result(persistent(name, mode, ts)[0])
        t = ts.double().cpu() / 1e3
        rows = []
        for ph in range(4):
            st, gm, gx, br = [], [], [], []
            for li in range(1, L - 1):
                i = li * 4 + ph
                st.append((t[i, :, 1] - t[i, :, 0]).median().item())
                gm.append((t[i, :, 2] - t[i, :, 1]).median().item())
                gx.append((t[i, :, 2] - t[i, :, 1]).max().item())
                br.append((t[i + 1, :, 0].median() - t[i, :, 2].max()).item())
            med = lambda v: sorted(v)[len(v) // 2]
            rows.append(f"{['qkv', 'o', 'gate_up', 'down'][ph]}: stage {med(st):.2f} gemv {med(gm):.2f} "
                        f"(slowest {med(gx):.2f}) barrier {med(br):.2f}")
        return "; ".join(rows)

    def result(fn) -> torch.Tensor:
        x.copy_(x0)
        fn()
        torch.cuda.synchronize()
        return x.clone()

    def timed(fn, graph: bool) -> float:
        x.copy_(x0)
        fn()
        torch.cuda.synchronize()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            fn = g.replay
        ts = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            x.copy_(x0)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / L)
        return sorted(ts)[len(ts) // 2]

    cuda_gemv.MMA = False
    ref = result(engine_chain)
    print(f"chain output: max |x| {ref.float().abs().max().item():.3g}, "
          f"nan {ref.isnan().sum().item()}, inf {ref.isinf().sum().item()}")
    cuda_gemv.MMA = True
    ref_mma = result(engine_chain)
    print(f"floor {nbytes / L / bw * 1e6:.1f} us a layer ({nbytes / L / 1e6:.1f} MB)")
    print(f"engine kernels, FMA only: {timed(engine_chain, True):.1f} us a layer (graph, PDL)")
    cuda_gemv.MMA = True
    print(f"engine kernels, default: {timed(engine_chain, True):.1f} us a layer; "
          f"max rel diff to FMA {((ref_mma.float() - ref.float()).abs().max() / ref.float().abs().max()).item():.2e}")
    for name in KERNELS:
        run, occ, _ = persistent(name)
        out = result(run)
        same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        print(f"{name} ({occ}): bit-equal to FMA chain {same}; {timed(run, False):.1f} us a layer; "
              f"first load after the wait {timed(persistent(name, 2)[0], False):.1f}; "
              f"barriers and x staging only {timed(persistent(name, 1)[0], False):.1f}; "
              f"no barriers {timed(persistent(name, 3)[0], False):.1f}", flush=True)
        print("  timeline:", timeline(name, 0), flush=True)


if __name__ == "__main__":
    main()
