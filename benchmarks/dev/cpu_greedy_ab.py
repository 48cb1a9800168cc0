"""The greedy head's candidate kernel at a git revision against the working tree's, on the
default model's LM head, each call cold, alternated in one process (this box drifts +-10-25%
between runs; median and min of --rounds). Prints the candidates a row too.

    .venv/bin/python benchmarks/dev/cpu_greedy_ab.py [--rev 6437eb2] [--rounds 24]

Before each call, 351 MB of other memory is read (a decode step's layer weights and KV), so that
the 171 MB copy streams from DRAM as in an engine step; with --warm, calls run back to back on a
4,096-row slice that stays in L2 (1.3 MB a core) (the kernel's instructions alone). x: 16 rows of
the table scaled like final-norm outputs; each kernel's candidates must hold each row's argmax
(float64), and their counts are printed. The revision's kernel is built with its own headers
and given its own byte order and x statistics: `--old-layout rows` (before 2026-11-24: rows in
their own order inside 64 x 32 pieces), `pairs` (bf16 kernels of 2026-11-24: row pairs
interleaved per 8-k chunk; the x statistics [2, M]), or `same` (greedy_head.greedy_layout).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.common import ab_modules  # noqa: E402
from flatserve import device as dev  # noqa: E402
from flatserve.model.greedy_head import greedy_layout, quantize_7bit, x_stats  # noqa: E402

SRC = "flatserve/ops/csrc/amx_gemm_cpu.cpp"  # the AMX GEMM kernel, as in cpu_gemm_ab.py


def rows_layout(u: torch.Tensor) -> torch.Tensor:
    """The byte order before the unpack conversion: [N/64, K/32, 64 rows, 32 k] pieces."""
    n, k = u.shape
    return u.reshape(n // 64, 64, k // 32, 32).transpose(1, 2).contiguous().reshape(n, k)


def pairs_layout(u: torch.Tensor) -> torch.Tensor:
    """The bf16 kernels' byte order (2026-11-24 until the int8 tiles): 64 x 32 pieces, per row
    pair and 8-k chunk j, u[r][8j:8j+8] then u[r + 1][8j:8j+8]."""
    n, k = u.shape
    pieces = rows_layout(u).view(n // 64, k // 32, 32, 2, 4, 8)
    return pieces.transpose(3, 4).contiguous().view(n, k)


def old_stats(x: torch.Tensor) -> torch.Tensor:
    """The bf16 kernels' x statistics: [2, M], |x_t|_1 rounded up and sum(x_t)."""
    xf = x.float()
    return torch.stack([xf.abs().sum(1) * (1 + x.shape[1] * 2.0**-23), xf.sum(1)]).contiguous()


def main() -> None:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from flatserve.model.loader import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="6437eb2")
    ap.add_argument("--old-layout", default="rows", choices=["rows", "pairs", "same"])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--warm", action="store_true")
    a = ap.parse_args()
    if not dev.cpu_has_amx_bf16():
        sys.exit("needs a CPU with AMX bf16")
    mods = ab_modules(SRC, a.rev, "flatserve_gemm_ab", "flatserve_amx_gemm")
    reader = GGUFReader(str(default_model_path()))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    shape = tuple(reversed([int(d) for d in emb.shape]))
    w = torch.from_numpy(np.ascontiguousarray(dequantize(emb.data, emb.tensor_type).reshape(shape),
                                              dtype=np.float32)).bfloat16()  # [262144, 640]: the tied LM head
    if a.warm:
        w = w[:4096]
    u, s, c = quantize_7bit(w)
    old = {"rows": rows_layout, "pairs": pairs_layout, "same": greedy_layout}[a.old_layout]
    layouts = {a.rev: old(u), "working tree": greedy_layout(u)}
    torch.manual_seed(0)
    # Rows of the table itself: each row's own logit stands out, as a trained model's final
    # hidden states make one token stand out (random x draws thousands of candidates a row).
    x = (w[torch.randint(0, w.shape[0], (16,))].float() * 4).bfloat16()
    stats = {a.rev: x_stats(x) if a.old_layout == "same" else old_stats(x), "working tree": x_stats(x)}
    top = (x.double() @ w.double().t()).argmax(1)
    counts = {}
    for k, m in mods.items():
        off, rows, _ = m.greedy_candidates(x, layouts[k], s, c, stats[k])
        for t in range(16):
            assert top[t].item() in rows[off[t]:off[t + 1]].tolist(), (k, t)
        counts[k] = (off[1:] - off[:-1]).tolist()
    other = torch.ones(351 * 2**20 // 4)
    times: dict[str, list[float]] = {k: [] for k in mods}
    names = list(mods)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if not a.warm:
                other.sum()
            t = time.perf_counter()
            mods[name].greedy_candidates(x, layouts[name], s, c, stats[name])
            times[name].append(time.perf_counter() - t)
    print(f"{w.shape[0]} x {w.shape[1]} head, 16 rows, {'warm (L2)' if a.warm else 'cold'}: " + ", ".join(
        f"{k} median {statistics.median(v) * 1e3:.3f} ms (min {min(v) * 1e3:.3f})" for k, v in times.items())
          + "; candidates a row " + ", ".join(f"{k} {min(v)}..{max(v)}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
