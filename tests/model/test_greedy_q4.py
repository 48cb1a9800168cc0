"""The bounded 4-bit greedy head on a Q8_0 LM head (flatserve/model/greedy_q4.py), at every ISA
level this CPU runs whose build has it (AVX2 and up; its copy has head rows in the lanes,
csrc/greedy_q4t.h): its token is `row_argmax(head(x))` of the quantized head itself, bit for
bit (ties to the first index included), on fresh random heads and inputs with outlier channels,
exact ties and ties one code step apart; the copy's error stays within its bound; non-finite
rows fall back to the head."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import device as dev
from flatserve import kernels
from flatserve.model import greedy_q4, greedy_q8, quant
from flatserve.model.greedy_q4 import Q4GreedyHead, eligible, quantize_q4
from flatserve.model.qformats import FORMATS, dequantize, quantize
from tests.conftest import require_kernel

Q8_0 = FORMATS["q8_0"]


def _head(w: torch.Tensor) -> quant.QuantLinear:
    lin = quant.QuantLinear(w.shape[1], {"": (w.shape[0], Q8_0)})
    lin.load_quant("", quantize(w, Q8_0), Q8_0)
    return lin


def _weights(n: int, k: int) -> torch.Tensor:
    # rows of different scales, and a few channels with larger weights (as LM heads have)
    w = torch.randn(n, k) * torch.rand(n, 1) * 0.1
    w[:, torch.randperm(k)[:4]] *= 5
    return w


def _x(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k)
    for c in random.sample(range(k), 3):  # outlier channels of either sign, as hidden states have
        x[:, c] *= random.choice([-40.0, 40.0])
    return x


def step_code(q8: torch.Tensor, row: int, j: int) -> None:
    """Moves the Q8_0 code byte j of `row` one step (down at 127)."""
    code = q8[row, j].view(torch.int8)
    q8[row, j] = (code + (1 if code < 127 else -1)).view(torch.uint8)


def head_of(q8: torch.Tensor, k: int) -> quant.QuantLinear:
    head = quant.QuantLinear(k, {"": (q8.shape[0], Q8_0)})
    head.load_quant("", q8, Q8_0)
    return head


def near_winner(w_win: torch.Tensor) -> torch.Tensor:
    """16 tokens: 25 x the winning row, then plus noise of 0.01 to 2.0."""
    x = (w_win * 25)[None].repeat(16, 1)
    x[1:] += torch.randn(15, w_win.shape[0]) * torch.linspace(0.01, 2.0, 15)[:, None]
    return x


def _ext() -> object:
    ext = require_kernel(quant._ext)
    if not ext.has_greedy_q8():
        pytest.skip(f"the {ext.isa()} build has no AVX2, where the greedy passes live")
    return ext


def decode_lanes(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The rows-in-lanes copy back to (c [G 16, nb, 32] int64, d [G 16, nb] int16 fp16 bits), by the
    layout csrc/greedy_q4t.h states: [g][nb][vector j][lane r][4 bytes], bytes (u0 | u2 << 4,
    u4 | u6 << 4, u1 | u3 << 4, u5 | u7 << 4) of values 8j..8j+7, u = c + 8; scales [g][nb][16]."""
    nb, g = k // 32, -(-n // 16)
    by = codes.reshape(g, nb, 4, 16, 4).permute(0, 3, 1, 2, 4).reshape(16 * g, nb, 4, 4).long()
    lo, hi = by & 15, by >> 4
    order = torch.stack([lo[..., 0], lo[..., 2], hi[..., 0], hi[..., 2], lo[..., 1], lo[..., 3], hi[..., 1],
                         hi[..., 3]], -1)  # values 8j + 0..7
    d = scales.reshape(g, nb, 16).permute(0, 2, 1).reshape(16 * g, nb)
    return order.reshape(16 * g, nb, 32) - 8, d


@pytest.mark.parametrize("k", [640, 96])  # the default model's K, and an odd number of blocks
def test_copy_errs_at_most_half_a_step(k: int, quant_isa: str) -> None:
    """Each weight of the copy within d / 2 of the head's (exact in float64), |c| <= 7, wmax
    above every |W| and |W4|, and the last group's padding rows zero in codes and scales."""
    _ext()
    n = 16 * random.randint(3, 12) + random.randint(1, 15)
    w = _weights(n, k)
    q8 = quantize(w, Q8_0)
    codes, scales, wmax = quantize_q4(q8, k)
    c, bits = decode_lanes(codes, scales, n, k)
    d = bits.contiguous().view(torch.float16).double()
    w4 = (c * d[..., None]).reshape(-1, k)
    wq = dequantize(q8, Q8_0, k).double()  # the head's values: exact in float64
    err = (wq - w4[:n]).abs().view(n, -1, 32)
    assert (err <= d[:n, :, None] / 2).all()
    assert (c.abs() <= 7).all() and (c[n:] == 0).all() and (bits[n:] == 0).all()
    assert wmax >= wq.abs().max().item() and wmax >= w4.abs().max().item() / (1 + 2**-10)


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_tokens_equal_the_quantized_head_argmax(rows: int, quant_isa: str, monkeypatch) -> None:
    _ext()
    monkeypatch.setattr(greedy_q4, "MAX_ROWS", 8)  # the kernel's whole range, not the served one
    n, k = 64 * random.randint(40, 120), random.choice([640, 96])
    w = _weights(n, k)
    a, b = sorted(random.sample(range(n), 2))
    w[b] = torch.randn(k) * 0.1  # at the largest scale, so that x = 40 w_b makes it the best
    w[a] = w[b]  # an exact tie: the first index must win
    head = _head(w)
    greedy = Q4GreedyHead(head)
    x = _x(rows, k)
    x[0] = w[b] * 40  # row 0's best: rows a and b tie exactly
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        ref = kernels.row_argmax(head(xd))
        if dtype == torch.float32:
            assert ref[0].item() == a
        got = greedy(xd)
        assert torch.equal(got, ref), (dtype, got, ref)
    assert greedy.fallbacks == 0 and (greedy.last_counts >= 1).all()


def test_ties_one_code_step_apart(quant_isa: str, monkeypatch) -> None:
    """Copies of the winning row with one Q8_0 code moved by one step: logits equal or one
    product apart, often equal after the head's bf16 rounding; the first maximum must win."""
    _ext()
    monkeypatch.setattr(greedy_q4, "MAX_ROWS", 8)
    n, k = 64 * 40, 640
    w = _weights(n, k)
    q8 = quantize(w, Q8_0)
    win = 700
    for i, row in enumerate([10, 300, 1500, 2500]):
        q8[row] = q8[win]
        step_code(q8, row, 2 + 34 * (i % 20) + 2 + i)  # a code byte of block i % 20
    head = head_of(q8, k)
    greedy = Q4GreedyHead(head)
    x = near_winner(dequantize(q8, Q8_0, k)[win])[:8]
    for dtype in (torch.bfloat16, torch.float32):
        ref = kernels.row_argmax(head(x.to(dtype)))
        assert torch.equal(greedy(x.to(dtype)), ref)
    assert greedy.fallbacks == 0


def test_non_finite_rows_and_large_calls_take_the_head(quant_isa: str) -> None:
    _ext()
    n, k = 64 * 20, 640
    head = _head(_weights(n, k))
    greedy = Q4GreedyHead(head)
    x = _x(greedy_q4.MAX_ROWS + 1, k).bfloat16()
    assert torch.equal(greedy(x), kernels.row_argmax(head(x)))  # past MAX_ROWS
    x[1, 3] = float("nan")
    assert torch.equal(greedy(x[:4]), kernels.row_argmax(head(x[:4])))
    assert greedy.fallbacks == 2


@pytest.mark.parametrize("pass_ms", [1.0, 3.0])  # against the head's 2.0: faster, slower
def test_served_head_times_both_paths_then_keeps_the_faster(pass_ms: float, quant_isa: str) -> None:
    """The served head's trial (for_model): its first one-row calls alternate pass and full head,
    each timed (here by a fake clock), with the head's tokens throughout; then the pass stays
    where it was faster, else the copy is freed and the head answers."""
    _ext()
    n, k = 64 * 20, 640
    head = _head(_weights(n, k))
    greedy = Q4GreedyHead(head, trial=True)
    readings, now = [0], [0.0]

    def clock() -> float:  # reading 2j starts call j, 2j + 1 ends it: pass on even j, head on odd
        r = readings[0]
        readings[0] += 1
        if r % 2:
            now[0] += (pass_ms if (r // 2) % 2 == 0 else 2.0) / 1e3
        return now[0]

    greedy.clock = clock
    for _ in range(2 * greedy_q4.TRIAL):
        x = _x(1, k).bfloat16()
        assert torch.equal(greedy(x), kernels.row_argmax(head(x)))
    assert greedy.times is None and readings[0] == 4 * greedy_q4.TRIAL and greedy.fallbacks == 0
    x = _x(1, k).bfloat16()
    greedy.last_counts = torch.empty(0, dtype=torch.int64)
    assert torch.equal(greedy(x), kernels.row_argmax(head(x)))
    if pass_ms < 2.0:
        assert greedy.copy is not None and greedy.fallbacks == 0 and greedy.last_counts.numel() == 1
    else:
        assert greedy.copy is None and greedy.copy_scales is None
        assert greedy.nbytes == 0 and greedy.fallbacks == 1
    assert readings[0] == 4 * greedy_q4.TRIAL  # no timing after the choice


def test_only_a_plain_q8_0_head_on_an_avx2_build_is_eligible(quant_isa: str, monkeypatch) -> None:
    n, k = 64, 640
    head = _head(_weights(n, k))
    ext = quant.kernel()
    assert eligible(head) == (ext is not None and ext.isa() in dev.AVX2_LEVELS)
    q6 = quant.QuantLinear(256, {"": (n, FORMATS["q6_k"])})
    assert not eligible(q6)
    head.bias = torch.nn.Parameter(torch.zeros(n))
    assert not eligible(head)


def test_default_model_greedy_tokens_with_and_without_the_head(default_model_path, monkeypatch) -> None:
    """The default GGUF (tied Q8_0 head): greedy generation through the bounded head gives the
    full head's tokens, one request and four at once (the kernel's range past MAX_ROWS)."""
    from flatserve import LLM

    _ext()
    monkeypatch.setattr(greedy_q4, "MAX_ROWS", 8)
    llm = LLM(device="cpu", model=str(default_model_path), kv_cache_memory=256 * 2**20, max_model_len=1024,
              greedy_int8_head=False)
    runner = llm.engine.runner
    served = greedy_q8.for_model(runner.model, runner.cfg)  # at avx2, avxvnni with this copy for one row
    if quant.kernel().isa() in dev.AVX2_LEVELS:
        assert served.one_row is not None and served.one_row.times is not None  # on trial first
    head = Q4GreedyHead(runner.model.lm_head)  # the pass itself at this level
    same_tokens_through(llm, head, ["The capital of France is", "def fib(n):", "Once upon a time",
                                    "1, 2, 3, 5, 8,"])


def same_tokens_through(llm: object, head: torch.nn.Module, prompts: list[str]) -> None:
    """Greedy generation with `head` as the runner's greedy head gives the full head's tokens,
    for the first prompt alone and for all of them at once; the head ran every step."""
    from flatserve import SamplingParams

    runner = llm.engine.runner
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for batch in ([prompts[0]], prompts):
        ref = [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
        runner.greedy_head = head
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
        finally:
            runner.greedy_head = None
        assert got == ref
    assert head.calls >= 12 and head.fallbacks == 0
