"""The bounded 7-bit greedy head (flatserve/model/greedy_head.py), on the AMX kernel and on the
AVX2 one, each where the CPU runs it: its token is the bf16 head's `row_argmax` exactly (ties to
the first index included) on fresh random heads, plain and packed; its error bound holds against
a float64 reference; bad rows fall back; and whole-model greedy generation is token-identical
with the head on and off."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import kernels
from flatserve.model import amx, avx2, greedy_head
from flatserve.model.greedy_head import Int8GreedyHead, quantize_7bit


def _avx2_vector() -> bool:
    return avx2.available(torch.bfloat16) and avx2._ext().vectorized()


GEMMS = ["amx", pytest.param("avx2", marks=pytest.mark.skipif(
    not _avx2_vector(), reason="no AVX2 + FMA here, or its kernel did not build"))]


@pytest.fixture(params=GEMMS)
def gemm(request, monkeypatch) -> str:
    if request.param == "amx":  # the amx level (skips where the CPU has none), its kernel built
        from tests.conftest import _at_level, require_kernel

        _at_level("amx", monkeypatch)
        require_kernel(amx._ext)
        assert amx.available(torch.bfloat16), "AMX kernel built but not available (OS tile grant, oneDNN)"
    return request.param


def _linear(gemm: str, w: torch.Tensor, plain: bool = True) -> torch.nn.Module:
    return (amx.AMXLinear if gemm == "amx" else avx2.AVX2Linear)(w, None, plain=plain)


def _head(gemm: str, n: int, k: int, plain: bool, dup: list[tuple[int, int]]) -> torch.nn.Module:
    w = (torch.randn(n, k) * torch.rand(n, 1) * 0.1).bfloat16()
    for a, b in dup:  # exact ties: the first index must win (row b at the largest scale)
        w[b] = (torch.randn(k) * 0.1).bfloat16()
        w[a] = w[b]
    return _linear(gemm, w, plain)


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_tokens_equal_the_bf16_head_argmax(gemm: str, plain: bool, rows: int, monkeypatch) -> None:
    monkeypatch.setattr(greedy_head, "UNION_CAP", 1)  # never skip the bounded path here
    n = 64 * random.randint(8, 200)
    k = 32 * random.choice([3, 20])  # an odd number of k steps, and the default model's 640
    a, b = sorted(random.sample(range(n), 2))
    head = _head(gemm, n, k, plain, [(a, b)])
    greedy = Int8GreedyHead(head)
    x = torch.randn(rows, k)
    x[:, random.randrange(k)] *= 30  # an outlier channel, as real hidden states have
    x[0] = head.plain_weight()[b].float() * 40  # row 0's best: rows a and b tie exactly
    x = x.bfloat16()
    ref = kernels.row_argmax(head(x))
    assert ref[0].item() == a
    got = greedy(x)
    assert torch.equal(got, ref), (got, ref)
    assert greedy.calls == 1 and greedy.fallbacks == 0


def test_ties_one_bf16_step_apart(gemm: str, monkeypatch) -> None:
    """Rows that differ from the winner by one bf16 ulp in one weight: logits equal or one
    rounding step apart after the head's bf16 rounding; the first maximum must still win."""
    n, k = 64 * 40, 640
    w = (torch.randn(n, k) * 0.05).bfloat16()
    x = (w[700].float() * 25).bfloat16()[None].repeat(4, 1)
    x[1:] += (torch.randn(3, k) * 0.5).bfloat16()
    for i, row in enumerate([10, 300, 1500, 2500]):  # copies of row 700, nudged by one ulp
        w[row] = w[700]
        j = i * 37
        w[row, j] = torch.nextafter(w[row, j].float(), torch.tensor(1e9)).bfloat16() \
            if w[row, j] > 0 else w[row, j]
    monkeypatch.setattr(greedy_head, "UNION_CAP", 1)
    head = _linear(gemm, w)
    greedy = Int8GreedyHead(head)
    assert torch.equal(greedy(x), kernels.row_argmax(head(x))) and greedy.fallbacks == 0


@pytest.mark.parametrize("plain", [True, False])
def test_rescoring_in_chunks_keeps_the_first_maximum(gemm: str, plain: bool, monkeypatch) -> None:
    """Candidates rescored RESCORE_ROWS at a time (64 here): ~200 rows tying exactly for the
    maximum, spread over the vocabulary, so the tie crosses chunks; the first index must win,
    and the other rows' tokens equal the bf16 head's too."""
    monkeypatch.setattr(greedy_head, "UNION_CAP", 1)
    monkeypatch.setattr(greedy_head, "RESCORE_ROWS", 64)
    n, k = 64 * random.randint(60, 120), 640
    w = (torch.randn(n, k) * torch.rand(n, 1) * 0.1).bfloat16()
    tied = sorted(random.sample(range(n), random.randint(150, 250)))
    w[tied] = (torch.randn(k) * 0.1).bfloat16()
    head = _linear(gemm, w, plain)
    greedy = Int8GreedyHead(head)
    x = torch.randn(5, k)
    x[0] = w[tied[0]].float() * 40
    x = x.bfloat16()
    ref = kernels.row_argmax(head(x))
    assert ref[0].item() == tied[0]
    assert torch.equal(greedy(x), ref) and greedy.fallbacks == 0


def test_bound_holds_against_float64(gemm: str) -> None:
    """|s (x . q) - x . w| <= |x|_1 c in float64 (the quantization part of the bound), and each
    token's candidates hold every row at the bf16 head's maximum."""
    n, k = 64 * 50, 640
    w = (torch.randn(n, k) * torch.rand(n, 1) * 0.2).bfloat16()
    u, s, c = quantize_7bit(w)
    assert int(u.min()) >= 1 and int(u.max()) <= 127
    x = (torch.randn(8, k) * 3).bfloat16()
    q = u.double() - 64
    est = (x.double() @ q.t()) * s.double()  # [8, N]
    exact = x.double() @ w.double().t()
    bound = x.double().abs().sum(1, keepdim=True) * c.double()
    assert ((est - exact).abs() <= bound).all()
    head = _linear(gemm, w)
    greedy = Int8GreedyHead(head)
    off, cand, union = greedy.candidates(x)
    assert union.tolist() == sorted(set(cand.tolist()))
    logits = head(x).float()
    for t in range(8):
        mine = set(cand[off[t]:off[t + 1]].tolist())
        top = torch.nonzero(logits[t] == logits[t].max()).flatten().tolist()
        assert set(top) <= mine  # every maximum among the candidates
        assert sorted(mine) == cand[off[t]:off[t + 1]].tolist()  # ascending, no repeats


def test_the_bound_covers_what_the_split_of_x_drops(gemm: str) -> None:
    """The kernel splits x into integers at 16 bits of max|x|; an outlier channel makes the
    other channels round to zero there. Row b gains only through those channels (its logit
    ~8.9), row a through one channel that survives (~2.0): the kernel's estimates rank a first,
    and only the bound's 63 s E term keeps b, the bf16 head's argmax, among the candidates."""
    k, a, b, m, out = 640, 3, 17, 5, 7
    w = torch.zeros(64, k)
    w[b] = 63 / 64
    w[b, m] = w[b, out] = 0
    w[a, m] = 40 / 64
    head = _linear(gemm, w.bfloat16())
    greedy = Int8GreedyHead(head)
    sx = 1024 / 32639  # the kernel's scale for max|x| = 1024
    x = torch.full((1, k), 0.45 * sx)
    x[0, out], x[0, m] = 1024, 100.4 * sx
    x = x.bfloat16()
    logits = head(x).float()[0]
    assert kernels.row_argmax(head(x)).item() == b and logits[b] - logits[a] > 4
    off, cand, _ = greedy.candidates(x)
    assert b in cand[off[0]:off[1]].tolist()
    assert greedy(x).item() == b


def test_the_first_stage_keeps_rows_that_only_the_low_bytes_reach(gemm: str) -> None:
    """The AVX2 pass first scores every row against x's high bytes alone (x ~= 256 sx xh). Here
    every channel but one holds 100 sx, which splits into xh = 0 and xl = 100: row b gains only
    through those channels (its logit ~1,960), row a through the one large channel (~1,020). The
    first stage sees b at ~0 and a at ~1,020; only its own error term (s_n |x - 256 sx xh|_2
    |q_n|_2) keeps b for the second stage, which finds it the argmax. A group of 32 rows is scored against
    the threshold its thread's earlier groups set, so every group holds a copy of row a and b is
    the last row: its thread has seen a before it at up to 32 threads (64 groups)."""
    k, a, out = 640, 3, 7
    w = torch.zeros(32 * 64, k)
    b = w.shape[0] - 1
    w[b] = 63 / 64
    w[b, out] = 0
    w[a::32, out] = 1.0
    head = _linear(gemm, w.bfloat16())
    greedy = Int8GreedyHead(head)
    sx = 1024 / 32639  # the kernel's scale for max|x| = 1024
    x = torch.full((1, k), 100 * sx)
    x[0, out] = 1024
    x = x.bfloat16()
    logits = head(x).float()[0]
    assert kernels.row_argmax(head(x)).item() == b and logits[b] - logits[a] > 500
    off, cand, _ = greedy.candidates(x)
    assert b in cand[off[0]:off[1]].tolist()
    assert greedy(x).item() == b and greedy.fallbacks == 0


def test_nan_and_many_rows_take_the_full_head(gemm: str) -> None:
    head = _head(gemm, 64 * 20, 64, True, [])
    greedy = Int8GreedyHead(head)
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = float("nan")
    assert torch.equal(greedy(x), kernels.row_argmax(head(x))) and greedy.fallbacks == 1
    many = torch.randn(40, 64).bfloat16()  # past MAX_ROWS: the bf16 head decides
    assert torch.equal(greedy(many), kernels.row_argmax(head(many))) and greedy.fallbacks == 2
    flat = torch.zeros(2, 64).bfloat16()  # every row ties: too many candidates to gather
    assert torch.equal(greedy(flat), kernels.row_argmax(head(flat))) and greedy.fallbacks == 3


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])  # tied (plain) / untied (packed) head
def test_greedy_generation_identical_with_the_head_on_and_off(gemm: str, family: str, tmp_path,
                                                              monkeypatch) -> None:
    from flatserve import LLM, SamplingParams
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint(family, tmp_path, seed=random.randrange(1000))
    rng = random.Random()
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(1, 150))]}
               for _ in range(8)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # A 512-token vocabulary of random weights: many near-equal logits, so candidate sets that
    # the cap would send to the bf16 head; the test wants the bounded path.
    monkeypatch.setattr(greedy_head, "UNION_CAP", 1)
    out = {}
    for on in (True, False):
        llm = LLM(device="cpu", model=str(path), dtype="bfloat16", cpu_gemm=gemm, max_model_len=256,
                  greedy_int8_head=on)
        head = llm.engine.runner.greedy_head
        assert (head is not None) == on
        out[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if on:  # every sampling step went through it, and none fell back to the bf16 head
            assert head.calls >= 24 and head.fallbacks == 0
        del llm
    assert out[True] == out[False]


def test_by_default_only_the_avx2_linears_take_the_copy(gemm: str, tmp_path) -> None:
    """greedy_int8_head left unset: the 7-bit copy with the AVX2 linears (no native bf16: one
    stream needs it), none with AMX (its 171 MB took bf16 peak RSS past 1.2 GiB); set, it rules."""
    from flatserve import LLM
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint("gemma3", tmp_path, seed=random.randrange(1000))
    for want, built in ((None, gemm == "avx2"), (True, True), (False, False)):
        llm = LLM(device="cpu", model=str(path), dtype="bfloat16", cpu_gemm=gemm, max_model_len=128,
                  greedy_int8_head=want)
        assert (llm.engine.runner.greedy_head is not None) == built, (gemm, want)
        del llm
