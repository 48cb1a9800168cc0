"""Sampler against hand-built distributions and hand-computed penalties."""
from __future__ import annotations

import math

import torch

from flatserve.engine.request import Request
from flatserve.engine.sampler import Sampler, expand, top_k_top_p
from flatserve.engine.sampling_params import SamplingParams


def _req(params: SamplingParams, prompt=(1, 2), out=()) -> Request:
    r = Request("r", list(prompt), params, 16)
    r.token_ids.extend(out)
    return r


def _sample(logits: torch.Tensor, reqs: list[Request], seed: int = 0):
    s = Sampler(logits.shape[-1], frozenset({0}), seed)
    rows = expand([(r, []) for r in reqs])
    toks, accepted, lps = s.sample(logits.clone(), rows, s.prepare(rows, torch.device("cpu")))
    assert accepted is None  # no drafts, no acceptance flags
    return toks, lps


def test_top_k_top_p_masks_exact() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log()
    kept = lambda out: (out > float("-inf")).tolist()[0]  # noqa: E731
    assert kept(top_k_top_p(logits, torch.tensor([2]), None)) == [True, True, False, False]
    # p=0.7: 0.4 + 0.3 reaches it, so the 0.2 and 0.1 tokens go.
    assert kept(top_k_top_p(logits, None, torch.tensor([0.7]))) == [True, True, False, False]
    assert kept(top_k_top_p(logits, None, torch.tensor([0.71]))) == [True, True, True, False]
    assert kept(top_k_top_p(logits, None, torch.tensor([0.05]))) == [True, False, False, False]


def test_min_p_and_top_k_only_draw_allowed_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(200, 1)
    reqs = [_req(SamplingParams(temperature=1.0, min_p=0.2, seed=i)) for i in range(200)]
    toks, _ = _sample(logits, reqs)
    assert set(toks.tolist()) <= {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert 2 in toks.tolist()  # 0.15 >= 0.1 survives
    reqs = [_req(SamplingParams(temperature=1.0, top_k=1, seed=i)) for i in range(50)]
    assert set(_sample(logits[:50], reqs)[0].tolist()) == {0}


def test_seed_reproducible_whatever_the_batch() -> None:
    V = 1000
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = _sample(logits, [_req(p)])[0].item()
    others = torch.randn(5, V)
    batch = torch.cat([others[:2], logits, others[2:]])
    reqs = [_req(SamplingParams(temperature=0.7)) for _ in range(2)] + [_req(p)] + \
        [_req(SamplingParams(temperature=1.3, seed=9)) for _ in range(3)]
    assert _sample(batch, reqs, seed=99)[0][2].item() == alone
    draws = {_sample(logits, [_req(SamplingParams(temperature=1.0, seed=s))])[0].item()
             for s in range(20)}
    assert len(draws) > 1, "different seeds draw differently"


def test_sampling_distribution_follows_temperature() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 4000
    reqs = [_req(SamplingParams(temperature=1.0)) for _ in range(n)]
    toks, _ = _sample(probs.log().repeat(n, 1), reqs, seed=3)
    freq = torch.bincount(toks, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25)
    r = _req(p, prompt=(1,), out=(3, 3, 2))
    s = Sampler(5, frozenset(), 0)
    out = s.apply_logits_processors(logits.clone(), expand([(r, [])]))[0]
    # token 0: unseen -> 2.0; token 1: in prompt, negative -> -1*2 = -2.0
    # token 2: once in output: 0.5/2 - 0.5*1 - 0.25 = -0.5; token 3: twice: 3/2 - 1.0 - 0.25 = 0.25
    assert torch.allclose(out, torch.tensor([2.0, -2.0, -0.5, 0.25, -2.0]))


def test_logit_bias_min_tokens_and_logprobs() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0, logit_bias={2: 10.0}, logprobs=2)
    toks, lps = _sample(logits, [_req(p)])
    assert toks.item() == 2
    lp = torch.tensor([5.0, 1.0, 10.0, 0.0]).log_softmax(-1)  # logprobs after processing
    assert lps[0][0][0] == 2 and math.isclose(lps[0][0][1], lp[2].item(), rel_tol=1e-5)
    assert [t for t, _ in lps[0][1:]] == [2, 0]
    # min_tokens hides eos (id 0) until enough tokens exist.
    toks, _ = _sample(logits, [_req(SamplingParams(temperature=0, min_tokens=3))])
    assert toks.item() == 1


def test_plain_greedy_on_model_dtype_equals_fp32_path() -> None:
    """Greedy rows with no processors take the max of the bf16 logits directly; it must pick what
    the fp32 path picks, ties included (first index), and logprobs=0 still returns logprobs."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    logits = torch.randn(12, 3000, generator=g).bfloat16()
    logits[::3, 7] = logits[::3, 1900] = logits[::3].max() + 1  # exact ties in every third row
    plain = [_req(SamplingParams(temperature=0)) for _ in range(12)]
    toks, lps = _sample(logits, plain)
    assert toks.tolist() == logits.float().argmax(-1).tolist() and lps == [None] * 12
    assert all(t == 7 for t in toks[::3].tolist())
    # One row asking for logprobs=0 sends the batch through the fp32 path: same tokens.
    toks0, lps0 = _sample(logits, plain[:-1] + [_req(SamplingParams(temperature=0, logprobs=0))])
    assert toks0.tolist() == toks.tolist() and lps0[-1] is not None and lps0[-1][0][0] == toks[-1].item()


def test_row_chunks_change_nothing(monkeypatch) -> None:
    """The fp32 path in chunks of rows (CHUNK_BYTES) gives each seeded, greedy or logprob row
    the same token, acceptance and logprobs as one pass over all rows."""
    import random

    from flatserve.engine import sampler as sm

    V = 500
    groups = []
    for i in range(9):  # requests verifying 0..3 drafts: rows of one request cross chunk edges
        p = random.choice([SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=2),
                           SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=20, seed=50 + i)])
        groups.append((_req(p, out=[3, 4]), [random.randrange(V) for _ in range(random.randint(0, 3))]))
    rows = expand(groups)
    logits = torch.randn(len(rows), V) * 3

    def run() -> tuple:
        s = Sampler(V, frozenset({0}), 0)
        st = s.prepare(rows, torch.device("cpu"))
        return s.sample(logits.clone(), rows, st)

    toks, acc, lps = run()
    monkeypatch.setattr(sm, "CHUNK_BYTES", 4 * V * 2)  # 2 rows a chunk
    toks2, acc2, lps2 = run()
    assert torch.equal(toks, toks2) and torch.equal(acc, acc2)
    for a, b in zip(lps, lps2):
        assert (a is None) == (b is None)
        if a is not None:
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x - y) < 1e-6 for (_, x), (_, y) in zip(a, b))
