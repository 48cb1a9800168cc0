"""Speculative decoding: exact greedy outputs, the rejection sampler's distribution, rollback."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from flatserve import LLM, SamplingParams
from tests.conftest import engine_families
from flatserve.engine.request import Request
from flatserve.engine.sampler import Sampler, accept_walk, expand
from flatserve.spec.ngram import ngram_lookup

# ------------------------------------------------------------------ rejection sampler


def _emit(sampler: Sampler, req: Request, logits: torch.Tensor, drafts: list[int], n: int):
    """n independent groups verifying `drafts` against the same target logits [k+1, V]."""
    groups = [(req, drafts)] * n
    rows = expand(groups)
    st = sampler.prepare(rows, torch.device("cpu"))
    toks, acc, _ = sampler.sample(logits.repeat(n, 1), rows, st)
    return accept_walk(groups, toks.tolist(), acc.long().tolist())


def _chi2(counts: np.ndarray, p: np.ndarray) -> float:
    exp = counts.sum() * p
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token the target gives zero mass was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


# chi-square critical values at alpha = 0.001 (df -> value), from the standard table
_CRIT = {3: 16.266, 4: 18.467, 5: 20.515, 7: 24.322}


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4)])
@pytest.mark.parametrize("draft_rank", [0, 3])  # the draft is the target's likeliest / a long shot
def test_rejection_sampling_keeps_the_target_distribution(params, draft_rank) -> None:
    V, n = 6, 20000
    g = torch.Generator().manual_seed(1234 + draft_rank)
    logits = torch.randn(2, V, generator=g) * 1.5  # [k+1, V]: row 0 verifies the draft, row 1 is the bonus
    ref = logits.double() / params.temperature
    if params.top_k:
        kth = ref.topk(params.top_k, dim=-1).values[:, -1:]
        ref = ref.masked_fill(ref < kth, float("-inf"))
    p = ref.softmax(-1).numpy()  # [2, V] the distribution plain sampling draws from
    d = int(np.argsort(-p[0])[draft_rank])
    sampler = Sampler(V, frozenset(), seed=7)
    out = _emit(sampler, Request("r", [1], params, 64), logits, [d], n)
    first = np.bincount([t[0] for t in out], minlength=V)
    second = np.bincount([t[1] for t in out if len(t) == 2], minlength=V)
    df0, df1 = int((p[0] > 0).sum()) - 1, int((p[1] > 0).sum()) - 1
    assert _chi2(first, p[0]) < _CRIT[df0]
    # Accepted groups continue with the bonus row: it must follow p[1] on its own.
    assert second.sum() > 1000 and _chi2(second, p[1]) < _CRIT[df1]
    acc = sum(len(t) == 2 for t in out) / n
    assert abs(acc - p[0][d]) < 4 * np.sqrt(p[0][d] * (1 - p[0][d]) / n)  # acceptance = p(draft)
    # The test has teeth: the draft-biased mixture (what accept-always would emit) fails it.
    biased = 0.5 * p[0] + 0.5 * np.eye(V)[d]
    assert _chi2(first, biased) > 10 * _CRIT[df0]


def test_greedy_rows_accept_exactly_the_argmax() -> None:
    V = 16
    logits = torch.randn(4, V)  # k = 3 drafts
    arg = logits.argmax(-1).tolist()
    req = Request("r", [1], SamplingParams(temperature=0), 64)
    sampler = Sampler(V, frozenset())
    assert _emit(sampler, req, logits, arg[:3], 1) == [arg]  # all accepted, then the bonus
    wrong = (arg[1] + 1) % V
    assert _emit(sampler, req, logits, [arg[0], wrong, arg[2]], 1) == [arg[:2]]


# ------------------------------------------------------------------ n-gram proposer


def test_ngram_lookup_prefers_longest_then_latest_match() -> None:
    toks = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3], np.int64)
    # Suffix (1, 2, 3) occurs at 0 (followed by 9, 9); suffix (2, 3) latest at 5 (7, 8): longest wins.
    assert ngram_lookup(toks, 2, 2, 4) == [9, 9]
    assert ngram_lookup(toks, 3, 2, 2) == [7, 8, 5]  # only bigrams: the latest occurrence
    assert ngram_lookup(np.array([4, 5, 6], np.int64), 3, 1, 3) == []
    assert ngram_lookup(np.array([4, 4], np.int64), 3, 1, 3) == [4]  # stops at the known tokens
    # In a loop the latest match has 1 token after it: take the latest one with k tokens after.
    assert ngram_lookup(np.array([6, 1, 2, 1, 2, 1, 2], np.int64), 3, 2, 2) == [1, 2, 1]


# ------------------------------------------------------------------ end to end


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(6):
        unit = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))]
        out.append(unit * (1 + i % 3) + unit[: i * 3])  # repetition gives n-grams something to find
    return out


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=40, temperature=0),
            SamplingParams(max_tokens=33, temperature=0, repetition_penalty=1.3),
            SamplingParams(max_tokens=40, temperature=0, logprobs=2),
            SamplingParams(max_tokens=25, temperature=0, min_tokens=20, frequency_penalty=0.5),
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[7, 11, 13]),
            SamplingParams(max_tokens=7, temperature=0)]


def _run(path, seed: int, **kw):
    llm = LLM(device="cpu", model=str(path), dtype="float32", **{"num_gpu_blocks_override": 200, **kw})
    outs = llm.generate(_prompts(seed), _params(), use_tqdm=False)
    eng = llm.engine
    assert eng.kv.num_used_blocks == 0  # rejected slots rolled back, nothing leaked
    eng.kv.check_invariants()
    return [o.outputs[0] for o in outs], eng


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    from tests.conftest import build_checkpoint

    root = tmp_path_factory.mktemp("draft")

    class Drafts(dict):  # a different random model of each family, built when first asked for
        def __missing__(self, family: str):
            self[family] = build_checkpoint(family, root / "other", seed=1)[0]
            return self[family]

    return Drafts()


@engine_families
@pytest.mark.parametrize("mode", ["ngram", "draft-self", "draft-other", "ngram-preempt"])
def test_greedy_identical_with_speculation(tiny_checkpoint, drafts, mode) -> None:
    family, path, _ = tiny_checkpoint
    # Fresh prompts every run (the seed is in any failure), except the preemption mode: its fixed
    # prompt set is one whose 6 requests overflow a 12-block pool, so preemption must happen.
    seed = 0 if mode == "ngram-preempt" else random.randrange(1 << 30)
    ref, _ = _run(path, seed)
    kw: dict = {"speculative_method": mode.split("-")[0], "num_speculative_tokens": 3}
    if mode.startswith("ngram"):  # a 1-token match drafts: random models that never loop get drafts too
        kw["prompt_lookup_min"] = 1
    if mode == "draft-self":  # the target as its own draft: every draft must be accepted
        kw.update(speculative_model=str(path), num_speculative_tokens=4)
    if mode == "draft-other":  # a different random model: most drafts rejected, output unchanged
        kw.update(speculative_model=str(drafts[family]))
    if mode == "ngram-preempt":
        kw.update(num_gpu_blocks_override=13, max_num_batched_tokens=256)
    got, eng = _run(path, seed, **kw)
    st = eng.spec
    print(f"\n{family} {mode}: {st.num_groups} verify steps, {st.num_draft_tokens} drafts, "
          f"acceptance {st.acceptance_rate:.2f}, mean acceptance length {st.mean_acceptance_length:.2f}")
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids, f"prompt seed {seed}"
        assert a.text == b.text and a.finish_reason == b.finish_reason
        if b.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert st.num_draft_tokens > 0
    if mode == "draft-self":
        assert st.acceptance_rate > 0.95
    if mode == "ngram-preempt":
        assert eng.scheduler.num_preemptions > 0


@engine_families
def test_draft_catch_up_opens_a_block(tiny_checkpoint) -> None:
    """The draft's catch-up writes KV at the newest token's position N - 1, which the target has
    not allocated when N - 1 starts a block. With the target as its own draft (all accepted,
    k = 3) a request emits 1, 5, 9, 13, 17 tokens; at 17 of 19 one draft is left (k = 1), and a
    16- or 32-token prompt puts N - 1 = P + 16 on a block boundary (block size 16)."""
    _, path, _ = tiny_checkpoint
    rng = random.Random()
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (16, 32, 17, 31)]
    params = SamplingParams(max_tokens=19, temperature=0, ignore_eos=True)
    outs = {}
    for kw in ({}, {"speculative_method": "draft", "speculative_model": str(path),
                    "num_speculative_tokens": 3}):
        llm = LLM(device="cpu", model=str(path), dtype="float32", num_gpu_blocks_override=200, **kw)
        outs[bool(kw)] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.kv.num_used_blocks == 0
        llm.engine.kv.check_invariants()
    assert outs[True] == outs[False] and all(len(t) == 19 for t in outs[True])


@engine_families
def test_stop_string_inside_accepted_drafts(tiny_checkpoint) -> None:
    """A stop string that ends on an accepted draft cuts the tokens accepted after it."""
    _, path, _ = tiny_checkpoint
    probe = LLM(device="cpu", model=str(path), dtype="float32", num_gpu_blocks_override=100)
    # ignore_eos: a random model may emit eos early, leaving no middle word to stop on. Special
    # tokens print no word, and random models loop (a random Granite repeats one word), so the
    # stop is the text of 3 words ending mid-output: it cannot end before the 3rd token.
    for _ in range(10):
        prompt = _prompts(random.randrange(1 << 30))[2]
        full = probe.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0]
        text = full.outputs[0].text
        words = list(re.finditer(r"w\d+", text))  # some tokenizer classes print no spaces ("w5w6")
        if len(words) >= 6:
            break
    else:
        pytest.fail("no fresh prompt gave a greedy output of 6 words, in 10 draws")
    m = len(words) // 2
    stop = text[words[m - 2].start():words[m].end()]
    sp = SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True)
    ref = probe.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    llm = LLM(device="cpu", model=str(path), dtype="float32", num_gpu_blocks_override=100,
              speculative_method="draft", speculative_model=str(path), num_speculative_tokens=5)
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (ref.text, ref.token_ids, "stop")
    assert llm.engine.kv.num_used_blocks == 0
