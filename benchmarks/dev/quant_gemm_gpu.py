"""The CUDA quantized linears (flatserve/model/quant_triton.py) against cuBLAS on bf16 weights, at
Llama-3-8B's linear shapes, per format and row count; the weight bytes each call reads over its
time (GB/s) beside the device's copy rate, the memory floor of a decode-sized call.

    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_gpu.py [--formats q4_0,q4_k,q8_0] [--rows 1,16,256,4096]
    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_gpu.py --sweep   # the GEMV's tiles, and each path by rows
    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_gpu.py --planar [--tiles] [--kb] --rows 1,16,64
        # q4_0 / q8_0: the stored blocks against the planar copy (quant_planar.py), in CUDA graphs
    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_gpu.py --gemm --rows 16,64,256,1024
        # the fused GEMM's tiles (quant_planar._gemm_kernel) against bf16 cuBLAS and the
        # decode path / dequantize + cuBLAS, per row count (compiles in parallel first)

Weights are random bytes with finite scales (timing does not depend on the values). Runtime
(estimate, not timed): a minute on an H100.
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def random_blocks(n: int, k: int, fmt, device: str):
    """uint8 [n, row_bytes] of random codes whose fp16 scale fields hold 2^-8 (finite)."""
    import torch

    w = torch.randint(0, 256, (n, fmt.row_bytes(k)), dtype=torch.uint8, device=device)
    blocks = w.view(n, -1, fmt.type_size)
    one = torch.tensor([2.0 ** -8], dtype=torch.float16).view(torch.uint8).to(device)
    offs = {"q6_k": [208], "q4_k": [0, 2], "q5_k": [0, 2]}.get(fmt.name, [0])
    for o in offs:
        blocks[..., o:o + 2] = one
    return w


def main() -> None:
    import torch
    from triton.testing import do_bench

    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import quant_triton
    from flatserve.model.qformats import FORMATS

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_0,q4_k,q8_0")
    ap.add_argument("--rows", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--planar", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="with --planar: sweep the planar kernels' tiles")
    ap.add_argument("--gemm", action="store_true", help="the fused GEMM's tiles by row count (q4_0)")
    ap.add_argument("--jobs", type=int, default=12, help="with --gemm: processes compiling the tiles")
    ap.add_argument("--kb", action="store_true", help="with --planar: the FMA kernel at one row, 4-32 "
                    "blocks a step (longer runs of each weight row a step)")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a.formats.split(","))
    if a.gemm:
        return gemm_sweep([int(r) for r in a.rows.split(",")], a.jobs)
    if a.planar:
        return planar(a.tiles, [int(r) for r in a.rows.split(",")], a.kb)
    bw = copy_bandwidth()  # bytes moved per second (read + write), as offline_gpu.py's floor
    print(f"{torch.cuda.get_device_name()}  copy rate {bw / 1e9:.0f} GB/s")
    rows = [int(r) for r in a.rows.split(",")]
    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            t_bf = do_bench(lambda: torch.matmul(x, dense.t(), out=out), warmup=10, rep=50) * 1e3
            line = f"{name:8s} {n:6d}x{k:<6d} M={m:5d}  bf16 {t_bf:8.1f} us ({dense.numel() * 2 / t_bf / 1e3:5.0f} GB/s)"
            for f in a.formats.split(","):
                fmt = FORMATS[f]
                w = random_blocks(n, k, fmt, "cuda")
                t = do_bench(lambda: quant_triton.qgemm(x, w, fmt, out), warmup=10, rep=50) * 1e3
                line += f" | {f} {t:8.1f} us ({w.numel() / t / 1e3:5.0f} GB/s, {t_bf / t:4.2f}x bf16)"
            print(line, flush=True)
    print(f"floor at one row: weight bytes / {bw / 1e9:.0f} GB/s")


def sweep(formats: list[str]) -> None:
    """One row: every (BLOCK_N, KB, splits, warps) of the GEMV, best three per shape and format.
    Then per row count, each path: the GEMV (<= 16), the 64-row tiles, dequantize + cuBLAS."""
    import itertools

    import torch
    from triton.testing import do_bench

    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import quant_triton as qt
    from flatserve.model.qformats import FORMATS

    bw = copy_bandwidth()
    for f, (name, (n, k)) in itertools.product(formats, SHAPES.items()):
        fmt = FORMATS[f]
        w = random_blocks(n, k, fmt, "cuda")
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        res = []
        for bn, kb, sp, wp in itertools.product((32, 64, 128), (1, 2, 4), (2, 4, 8, 16), (4,)):
            if (k // 32) % (kb * sp):
                continue
            t = do_bench(lambda: qt.gemv(x, w, fmt, out, (bn, kb, sp, wp)), warmup=5, rep=20) * 1e3
            res.append((t, bn, kb, sp, wp))
        res.sort()
        auto = do_bench(lambda: qt.gemv(x, w, fmt, out), warmup=5, rep=20) * 1e3
        tiles = qt._gemv_tiles(x.device, n, k // 32, qt.KERNEL_FORMATS[f] <= 1)
        print(f"{f} {name:8s} floor {w.numel() / bw * 1e6:6.1f} us  auto {tiles} "
              f"{auto:6.1f} us  best " + "  ".join(f"{t:6.1f} us {c}" for t, *c in res[:3]), flush=True)
    for f in formats[:1]:
        fmt = FORMATS[f]
        for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 2, 4, 8, 16, 32, 64, 128)):
            w = random_blocks(n, k, fmt, "cuda")
            dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            paths = {"bf16": lambda: torch.mm(x, dense.t(), out=out),
                     "dequant_mm": lambda: qt.dequant_mm(x, w, fmt, out)}
            if m <= qt.GEMV_ROWS:
                paths["gemv"] = lambda: qt.gemv(x, w, fmt, out)
            ts = {p: do_bench(fn, warmup=5, rep=20) * 1e3 for p, fn in paths.items()}
            print(f"{f} {name:8s} M={m:4d} " + "  ".join(f"{p} {t:7.1f}" for p, t in ts.items()), flush=True)


def copies(make, nbytes: int) -> list:
    """make() (an nbytes tensor) called until the copies hold over 2x the GPU's L2, at least once:
    calls cycling through them find no weight cached."""
    import torch

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return [make() for _ in range(max(1, -(-2 * l2 // nbytes)))]


def graph_us(fns: list, calls: int = 24, replays: int = 7) -> float:
    """Median device time of one call, in us: `calls` calls cycling through `fns` (each over its
    own copy of the weights, together over 2x the L2, so no call finds its weights cached)
    captured in one CUDA graph, so the host's launch time (Triton's ~20 us a launch in Python)
    does not count, only the device's, gaps between kernels included, as in the engine's
    graphs."""
    import torch

    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[len(ts) // 2]


def planar(tiles: bool, rows: list[int], kb: bool = False) -> None:
    """The planar copy against the stored blocks, q4_0 and q8_0: with `tiles`, a grid of (BLOCK_N,
    KB, splits, warps, stages) of the FMA kernel at one and two rows and of the tensor-core
    kernel at 16 rows, best three (with `kb`, the FMA kernel's blocks a step); then per row
    count cuBLAS on bf16 weights, the stored blocks' path and the planar one, the latter also
    as it was before the fused GEMM (quant_planar.GEMM off) (device us per call, graph_us; GB/s
    = weight bytes / time)."""
    import itertools

    import torch

    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import quant_planar as qp
    from flatserve.model import quant_triton as qt
    from flatserve.model.qformats import FORMATS

    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}  copy rate {bw / 1e9:.0f} GB/s (read + written), "
          f"L2 {l2 >> 20} MiB", flush=True)

    for name, (n, k) in SHAPES.items() if kb else ():
        fmt = FORMATS["q4_0"]
        ps = copies(lambda: qp.repack(random_blocks(n, k, fmt, "cuda"), fmt), n * fmt.row_bytes(k))
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        res = [(graph_us([lambda p=p, c=c: qp.qgemm(x, p, fmt, out, c) for p in ps]), *c)
               for c in itertools.product((32, 64), (4, 8, 16, 32), (2, 4, 8), (4,), (0,))
               if (k // 32) % (c[1] * c[2]) == 0]
        print(f"kb q4_0 {name:8s} M= 1 floor {ps[0].numel() / bw * 1e6:6.1f} us  "
              + "  ".join(f"{t:6.1f} {c}" for t, *c in sorted(res)[:6]), flush=True)
    for f, (name, (n, k)) in itertools.product(("q4_0", "q8_0") if tiles else (), SHAPES.items()):
        fmt = FORMATS[f]
        ps = copies(lambda: qp.repack(random_blocks(n, k, fmt, "cuda"), fmt), n * fmt.row_bytes(k))
        # (BLOCK_N, KB, splits, warps, stages): the FMA kernel at 1 and 2 rows, the tensor-core
        # one at 16 (q4_0)
        for m, grid in ((1, itertools.product((64, 128), (4, 8), (2, 4, 8, 16), (4, 8), (0, 3))),
                        (2, itertools.product((64, 128), (4, 8), (4, 8), (4,), (0, 3))),
                        (16, itertools.product((64, 128), (1, 2), (4, 8, 16), (4, 8), (2, 3)))):
            if m == 16 and f != "q4_0":
                continue
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            res = []
            for c in grid:
                if (k // 32) % (c[1] * c[2]):
                    continue
                try:
                    res.append((graph_us([lambda p=p, c=c: qp.qgemm(x, p, fmt, out, c) for p in ps]), *c))
                except Exception as e:  # noqa: BLE001 (a tile that does not compile: say so, go on)
                    print(f"  {f} {name} M={m} {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            res.sort()
            auto = graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps])
            print(f"tiles {f} {name:8s} M={m:2d} floor {ps[0].numel() / bw * 1e6:6.1f} us  auto "
                  f"{qp._tiles(x.device, n, k // 32, m)} {auto:6.1f} us  best "
                  + "  ".join(f"{t:6.1f} us {c}" for t, *c in res[:3]), flush=True)
    for f in ("q4_0", "q8_0"):
        fmt = FORMATS[f]
        for name, (n, k) in SHAPES.items():
            ws = copies(lambda: random_blocks(n, k, fmt, "cuda"), n * fmt.row_bytes(k))
            ps = [qp.repack(w, fmt) for w in ws]
            denses = copies(lambda: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02, 2 * n * k)
            nb = ws[0].numel()
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                t_bf = graph_us([lambda d=d: torch.mm(x, d.t(), out=out) for d in denses])
                t_st = graph_us([lambda w=w: qt.qgemm(x, w, fmt, out) for w in ws])
                t_pl = graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps])
                qp.GEMM = False
                t_old = graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps])
                qp.GEMM = True
                print(f"rows {f} {name:8s} M={m:4d} floor {nb / bw * 1e6:6.1f} us | bf16 {t_bf:7.1f} | "
                      f"stored {t_st:7.1f} ({nb / t_st / 1e3:5.0f} GB/s) | planar {t_pl:7.1f} "
                      f"({nb / t_pl / 1e3:5.0f} GB/s, {t_st / t_pl:4.2f}x stored, "
                      f"{t_bf / t_pl:4.2f}x bf16) | planar before the fused GEMM {t_old:7.1f} "
                      f"({t_old / t_pl:4.2f}x){' (fused GEMM)' if qp.use_gemm(m, n, k) else ''}",
                      flush=True)
            del ws, ps, denses


def gemm_configs(m: int) -> list[tuple[int, ...]]:
    """(BLOCK_M, BLOCK_N, KB, splits, warps, stages) tried at m rows (splits 0: the auto rule's)."""
    import itertools

    bms = [b for b in (16, 32, 64, 128, 256) if b <= max(16, m) and b * (8 if m >= 512 else 4) >= m]
    out = []
    for bm, bn, kb, warps, stages in itertools.product(bms, (64, 128, 256), (2, 4), (4, 8), (3, 4)):
        if bm * bn >= 256 * 256 or (bm * bn >= 128 * 256 and warps == 4) or (bm <= 32 and warps == 8) \
                or (m >= 512 and bn == 64):
            continue
        out.append((bm, bn, kb, 0, warps, stages))
    return out


def _gemm_job(jobs: list) -> int:
    """Compile (and run once) each (shape, m, tiles): fills Triton's cache for the timing process."""
    import torch

    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    fmt, bad = FORMATS["q4_0"], 0
    for name, m, c in jobs:
        n, k = SHAPES[name]
        p = torch.zeros(n, fmt.row_bytes(k), dtype=torch.uint8, device="cuda")
        x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        try:
            qp.gemm(x, p, fmt, out, _resolve(c, m, n, k))
        except Exception:  # noqa: BLE001 (out of shared memory: the timing pass reports it)
            bad += 1
    torch.cuda.synchronize()
    return bad


def _resolve(c: tuple[int, ...], m: int, n: int, k: int) -> tuple[int, ...]:
    """Splits 0 -> the auto rule's splits for this tile."""
    import torch

    from flatserve.model import quant_planar as qp

    if c[3]:
        return c
    auto = qp._gemm_tiles(torch.device("cuda"), m, n, k // 32, bm=c[0], bn=c[1], kb=c[2])
    return c[:3] + (auto[3],) + c[4:]


def gemm_sweep(rows: list[int], jobs: int) -> None:
    """q4_0, per shape and row count: bf16 cuBLAS, the path qgemm took before the fused GEMM
    (the tensor-core GEMV up to 32 rows, else dequantize + cuBLAS), the fused GEMM with the auto
    tiles, and the best 5 of gemm_configs (device us per call in CUDA graphs, graph_us)."""
    import multiprocessing as mp
    import time

    import torch

    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    fmt = FORMATS["q4_0"]
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}  L2 {l2 >> 20} MiB", flush=True)
    todo = [(name, m, c) for name in SHAPES for m in rows for c in gemm_configs(m)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(jobs) as pool:
        bad = sum(pool.map(_gemm_job, [todo[i::jobs] for i in range(jobs)]))
    print(f"compiled {len(todo)} (shape, rows, tiles) in {time.time() - t0:.0f} s, {bad} failed", flush=True)
    for name, (n, k) in SHAPES.items():
        ps = copies(lambda: qp.repack(random_blocks(n, k, fmt, "cuda"), fmt), n * fmt.row_bytes(k))
        denses = copies(lambda: torch.randn(n, k, dtype=torch.bfloat16, device="cuda"), 2 * n * k)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            t_bf = graph_us([lambda d=d: torch.mm(x, d.t(), out=out) for d in denses])
            qp.GEMM = False
            t_old = graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps])
            qp.GEMM = True
            t_auto = graph_us([lambda p=p: qp.gemm(x, p, fmt, out) for p in ps])
            res = []
            for c in gemm_configs(m):
                c = _resolve(c, m, n, k)
                try:
                    res.append((graph_us([lambda p=p, c=c: qp.gemm(x, p, fmt, out, c) for p in ps]), c))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} M={m} {c}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            res.sort()
            auto = qp._gemm_tiles(x.device, m, n, k // 32)
            print(f"gemm q4_0 {name:8s} M={m:5d} bf16 {t_bf:7.1f} | old {t_old:7.1f} | auto "
                  f"{auto} {t_auto:7.1f} ({t_bf / t_auto:4.2f}x bf16) | best "
                  + "  ".join(f"{t:7.1f} {c}" for t, c in res[:5]), flush=True)
        del ps, denses


if __name__ == "__main__":
    main()
