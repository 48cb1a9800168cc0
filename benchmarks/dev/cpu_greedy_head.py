"""The default model's LM head (dequantized to bf16) for greedy rows: bf16 head + argmax vs the
bounded 7-bit greedy head, on the AMX or the AVX2 kernel (whichever the CPU runs). `--gguf`: the
GGUF's own Q8_0 head (kept quantized) + argmax vs the bounded greedy head the build serves: at the
avx512 level (flatserve/model/greedy_q8.py) the rows-in-lanes 4-bit copy up to FEW_ROWS rows and
the int8 pass on the head's codes above, else the 4-bit copy (flatserve/model/greedy_q4.py).

    .venv/bin/python benchmarks/dev/cpu_greedy_head.py [--rows 1,4,16] [--reps 30] [--gguf [--few-rows 8]
        [--int8-from N]]
    .venv/bin/python benchmarks/dev/cpu_greedy_head.py --bits 7,6,5 [--random-prompts]

Real hidden states: the final-norm outputs of the benchmark's 16 prompts (benchmarks/offline_cpu.py)
over 24 greedy steps. For each row count, the two paths alternate on the same inputs (median
ms); the tokens must agree, and the candidate rows per token are reported (median / max).
Floor: the bf16 head reads N x K x 2 bytes, the 7-bit one N x K + 8 N.

`--bits B,..`: no timing; how many rows a smaller copy would keep. For per-row symmetric copies
of B bits (|q| <= 2^(B-1) - 1) of the bf16 head, in float64: a row n is a candidate for hidden
row x when s_n (q_n . x) + e_n >= max_m (s_m (q_m . x) - e_m), e_n = min(|x|_1 max|w_n - s_n q_n|,
|x|_2 |w_n - s_n q_n|_2) (the bound with no rounding terms, so a lower count than the kernels');
per token, and the union over each 16 consecutive rows (a 16-stream step rescores the union).
`--random-prompts`: 16 prompts of 256 random token ids (the serving benchmark's dataset) instead.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")


def main() -> None:
    from benchmarks.common import make_prompts
    from flatserve import LLM, SamplingParams, kernels
    from flatserve.model import greedy_q8
    from flatserve.model.quant import kernel as greedy_q4_ext

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gguf", action="store_true", help="the quantized Q8_0 head and its 4-bit copy")
    ap.add_argument("--bits", default="", help="candidate counts of B-bit copies (no timing)")
    ap.add_argument("--random-prompts", action="store_true")
    ap.add_argument("--few-rows", type=int, default=None,
                    help="greedy_q8.FEW_ROWS for this run: the copy's pass up to that many rows (at most 8)")
    ap.add_argument("--int8-from", type=int, default=None,
                    help="greedy_q8.AVX2_MIN_ROWS for this run (avx2 and avxvnni builds): the int8 pass "
                    "from that many rows")
    a = ap.parse_args()
    if a.int8_from is not None:
        greedy_q8.AVX2_MIN_ROWS = dict.fromkeys(greedy_q8.AVX2_MIN_ROWS, a.int8_from)
    if a.few_rows is not None:
        from flatserve.model import greedy_q8 as g8

        g8.FEW_ROWS = a.few_rows
    llm = LLM(kv_cache_memory=512 * 2**20, max_model_len=4096, dequantize=not a.gguf,
              greedy_int8_head=None if a.gguf else True)
    model = llm.engine.runner.model
    greedy = llm.engine.runner.greedy_head
    if a.gguf:
        from flatserve.model.greedy_q4 import Q4GreedyHead

        greedy = greedy or Q4GreedyHead(model.lm_head)
    assert greedy is not None, "needs the AMX or AVX2 path with greedy_int8_head on"
    hidden: list[torch.Tensor] = []
    orig = model.compute_logits

    def keep(h: torch.Tensor) -> torch.Tensor:
        hidden.append(h.detach().clone())
        return orig(h)

    greedy_call = greedy.forward

    def keep_greedy(x: torch.Tensor) -> torch.Tensor:
        hidden.append(x.detach().clone())
        return greedy_call(x)

    model.compute_logits, greedy.forward = keep, keep_greedy
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 200_000) for _ in range(256)]} for _ in range(16)] \
        if a.random_prompts else make_prompts(16)
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    model.compute_logits, greedy.forward = orig, greedy_call
    if getattr(greedy, "one_row", None) is not None:  # avx2: the pass itself, not its trial (which
        from flatserve.model.greedy_q4 import Q4GreedyHead  # may have freed the copy by now)

        greedy.one_row = Q4GreedyHead(greedy.head)
    h = torch.cat(hidden)  # [R, K]
    head = greedy.head
    if a.bits:
        return bits_report(h, head.plain_weight(), [int(b) for b in a.bits.split(",")])
    if a.gguf:
        n, k = head.out_features, head.in_features
        rate = read_rate()
        print(f"{h.shape[0]} hidden rows; head {n} x {k}; Q8_0 reads {head.weight_bytes() / 1e6:.0f} MB; "
              f"{type(greedy).__name__} keeps {greedy.nbytes / 1e6:.1f} MB more; this CPU reads "
              f"{rate / 1e9:.1f} GB/s ({torch.get_num_threads()} threads): the head's floor "
              f"{head.weight_bytes() / rate * 1e3:.2f} ms")
    else:
        n, k = greedy.qweight.shape
        print(f"{h.shape[0]} hidden rows; head {n} x {k}; bf16 reads {n * k * 2 / 1e6:.0f} MB, "
              f"7-bit copy {(n * k + 12 * n) / 1e6:.0f} MB")
    print("| rows | full head + argmax ms | bounded greedy ms | ratio | its candidate kernel ms (4-bit: with the rescoring) | "
          "candidates median / max |")
    print("|---|---|---|---|---|---|")
    for m in (int(x) for x in a.rows.split(",")):
        full_t, int8_t, kern_t, counts = [], [], [], []
        for i in range(a.reps):
            x = h[(i * m) % (h.shape[0] - m):][:m].contiguous()
            t0 = time.perf_counter()
            ref = kernels.row_argmax(head(x))
            t1 = time.perf_counter()
            got = greedy(x)
            t2 = time.perf_counter()
            assert torch.equal(ref, got), (ref, got)
            full_t.append(t1 - t0)
            int8_t.append(t2 - t1)
            t3 = time.perf_counter()
            one_row = getattr(greedy, "one_row", None)  # the AVX2 builds' greedy_q4 copy
            if a.gguf and one_row is not None and m < greedy_q8.AVX2_MIN_ROWS[greedy.isa]:
                _, cnt = greedy_q4_ext().greedy_q4t_argmax(x, head.qweight0, one_row.copy,
                                                           one_row.copy_scales, one_row.wmax)
                off = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)])
            elif a.gguf and hasattr(greedy, "copy_codes") and m <= greedy_q8.FEW_ROWS:  # rows in lanes
                _, cnt = greedy_q4_ext().greedy_q4t_argmax(x, head.qweight0, greedy.copy_codes,
                                                           greedy.copy_scales, greedy.wmax)
                off = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)])
            elif a.gguf and hasattr(greedy, "sums"):  # the int8 pass (avx512 and AVX2 builds)
                _, cnt = greedy_q4_ext().greedy_q8_argmax(x, head.qweight0, greedy.sums, greedy.norms)
                off = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)])
            elif a.gguf:
                _, cnt = greedy_q4_ext().greedy_q4t_argmax(x, head.qweight0, greedy.copy, greedy.copy_scales,
                                                           greedy.wmax)
                off = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)])
            else:
                off, _, _ = greedy.candidates(x)
            kern_t.append(time.perf_counter() - t3)
            counts += (off[1:] - off[:-1]).tolist()
        f, g = statistics.median(full_t) * 1e3, statistics.median(int8_t) * 1e3
        kt = statistics.median(kern_t) * 1e3
        print(f"| {m} | {f:.2f} | {g:.2f} | {f / g:.2f}x | {kt:.2f} | {statistics.median(counts):.0f} / "
              f"{max(counts)} |", flush=True)


def read_rate() -> float:
    """Bytes a second the process reads from memory: the best of 5 sums over 1 GiB of int64."""
    a = torch.randint(0, 100, (1 << 27,), dtype=torch.int64)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 8 / best


def bits_report(h: torch.Tensor, w: torch.Tensor, bits: list[int]) -> None:
    """Candidate rows per token and per 16-row union for B-bit per-row copies (--bits)."""
    x = h[: h.shape[0] // 16 * 16].double()  # [R, K]
    n = w.shape[0]
    print(f"{x.shape[0]} hidden rows; head {n} x {w.shape[1]}")
    print("| bits | candidates per token, median / max | union of 16 rows, median / max |")
    print("|---|---|---|")
    for b in bits:
        levels = (1 << (b - 1)) - 1
        est = torch.empty(x.shape[0], n, dtype=torch.float64)
        err = torch.empty_like(est)
        for i in range(0, n, 16384):
            wc = w[i:i + 16384].double()
            s = wc.abs().amax(1).clamp(min=1e-30) / levels
            q = torch.round(wc / s[:, None]).clamp(-levels, levels) * s[:, None]
            e = wc - q
            est[:, i:i + 16384] = x @ q.T
            err[:, i:i + 16384] = torch.minimum(x.abs().sum(1)[:, None] * e.abs().amax(1)[None],
                                                x.norm(dim=1)[:, None] * e.norm(dim=1)[None])
        cand = est + err >= (est - err).amax(1, keepdim=True)  # [R, N]
        per = cand.sum(1)
        union = torch.stack([cand[j:j + 16].any(0).sum() for j in range(0, x.shape[0], 16)])
        print(f"| {b} | {per.median():.0f} / {per.max()} | {union.median():.0f} / {union.max()} |",
              flush=True)


if __name__ == "__main__":
    main()
