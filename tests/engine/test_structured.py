"""Constrained decoding: the bitmask op against a per-token reference, the sampler under masks on
random logits (a property test over random JSON schemas: no sampled token ever leaves the
grammar), and the speculative path (draft rows filled after tentative accepts, then rolled back;
a draft the grammar refuses is rejected by the sampler)."""
from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flatserve.engine.request import Request  # noqa: E402
from flatserve.engine.sampler import Sampler, expand  # noqa: E402
from flatserve.engine.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402
from flatserve.engine.structured import (  # noqa: E402
    GrammarCache, apply_bitmask, fill_bitmask, json_schema_ebnf)


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for i in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            if not (int(bitmask[i, j // 32]) >> (j % 32)) & 1:
                out[i, j] = float("-inf")
    return out


@pytest.mark.parametrize("device,impl", [("cpu", "auto"), ("cpu", "torch"), pytest.param(
    "cuda", "auto", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_apply_bitmask_matches_per_token_reference(device: str, impl: str) -> None:
    g = torch.Generator().manual_seed(7)
    R, V = 5, 203  # V not a multiple of 32: the last word is partly padding
    logits = torch.randn(R, V, generator=g)
    bm = torch.randint(-2**31, 2**31 - 1, (R, (V + 31) // 32), generator=g, dtype=torch.int64)
    bm = bm.to(torch.int32)
    bm[2] = -1  # an unconstrained row: all bits set
    want = _reference_mask(logits, bm)
    got = apply_bitmask(logits.to(device), bm.to(device), impl).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    assert not torch.isinf(got[2]).any()


@pytest.fixture(scope="module")
def cache(default_model_path) -> GrammarCache:
    from flatserve.engine.startup import load_tokenizer
    from flatserve.model.loader import resolve_model

    tok = load_tokenizer(resolve_model(str(default_model_path)), None)
    eos = [tok.eos_token_id]
    c = GrammarCache(tok, 262144, eos)
    yield c
    c.shutdown()


def _req(spec: StructuredOutputs, cache: GrammarCache, temperature: float = 1.0) -> Request:
    p = SamplingParams(max_tokens=64, temperature=temperature, structured_outputs=spec)
    r = Request("r", [2, 100, 200], p, 64)
    r.grammar = cache.request_grammar(spec, [1])
    r.grammar.compiled.result()
    assert r.grammar.poll() and r.grammar.failed is None
    return r


def _decode(cache: GrammarCache, ids: list[int]) -> str:
    return cache._tokenizer.decode(ids)


# Random schemas: every leaf bounded (enums, short strings, ranged integers, short arrays) so that
# sampling from random logits finishes within the step budget most of the time.
_leaf = st.one_of(
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 4)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["a", "b", "xy", "z z"]),
                                                    min_size=1, max_size=3, unique=True)),
    st.just({"type": "boolean"}),
)
_schema = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda it, lo, extra: {"type": "array", "items": it, "minItems": lo,
                                     "maxItems": lo + extra},
              inner, st.integers(0, 2), st.integers(0, 1)),
    st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                             "additionalProperties": False},
              st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, min_size=1, max_size=3)),
), max_leaves=4)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schema, seed=st.integers(0, 2**31 - 1))
def test_sampled_tokens_never_leave_random_schema(cache: GrammarCache, schema: dict, seed: int) -> None:
    """Random logits (the worst case for a grammar: no model prior), masked and sampled at
    temperature 1 through the real Sampler; every token must be one the matcher accepts, and a
    finished output must validate against the schema."""
    spec = StructuredOutputs(json={"type": "object", "properties": {"v": schema},
                                   "required": ["v"], "additionalProperties": False})
    req = _req(spec, cache)
    sampler = Sampler(262144, frozenset({1}), seed)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(60):
        rows = expand([(req, [])])
        st_ = sampler.prepare(rows, torch.device("cpu"))
        st_.bitmask = fill_bitmask(rows, 262144)
        tok = int(sampler.sample(torch.randn(1, 262144, generator=g), rows, st_)[0][0])
        assert req.grammar.matcher.accept_token(tok), (schema, _decode(cache, out), tok)
        if req.grammar.matcher.is_terminated():
            break
        out.append(tok)
        req.token_ids.append(tok)
    if req.grammar.matcher.is_terminated():
        jsonschema.validate(json.loads(_decode(cache, out)), spec.json)


def test_draft_rows_masked_after_tentative_accepts_then_rolled_back(cache: GrammarCache) -> None:
    spec = StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                   "required": ["n"], "additionalProperties": False})
    tok = cache._tokenizer
    good = tok('{"n', add_special_tokens=False).input_ids
    bad = tok("hello", add_special_tokens=False).input_ids[0]
    req = _req(spec, cache, temperature=0.0)
    drafts = good + [bad, good[0]]  # valid prefix, then a token the grammar refuses, then more
    rows = expand([(req, drafts)])
    bm = fill_bitmask(rows, 262144)
    # Reference: a fresh matcher walked token by token.
    ref = xgr.GrammarMatcher(req.grammar.compiled.result())
    want = xgr.allocate_token_bitmask(len(good) + 1, 262144)
    for j in range(len(good) + 1):
        ref.fill_next_token_bitmask(want, j)
        if j < len(good):
            assert ref.accept_token(good[j])
    assert torch.equal(bm[:len(good) + 1], want)
    bad_row = len(good)
    assert not (int(bm[bad_row, bad // 32]) >> (bad % 32)) & 1  # the refused draft is masked there
    # Rolled back: the request's own matcher still stands before any draft.
    again = fill_bitmask(expand([(req, [])]), 262144)
    assert torch.equal(again[0], want[0])
    # The sampler then accepts exactly the valid drafts (greedy rows; logits favour every draft).
    sampler = Sampler(262144, frozenset({1}))
    st_ = sampler.prepare(rows, torch.device("cpu"))
    st_.bitmask = bm
    logits = torch.zeros(len(rows), 262144)
    for j, d in enumerate(drafts):
        logits[j, d] = 10.0
    _, accepted, _ = sampler.sample(logits, rows, st_)
    assert accepted[:len(good)].all() and not accepted[bad_row]


def test_bounded_strings_mask_every_control_character(cache: GrammarCache) -> None:
    """Inside a length-bounded string every token that holds a control character (a tab, the
    tab runs Gemma's vocabulary has, a byte token below 0x20) is masked: xgrammar 0.2.9 alone lets
    them through unescaped (structured.json_schema_ebnf says why). Ordinary text still passes,
    and the bound still closes the string."""
    spec = StructuredOutputs(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
                                   "required": ["s"], "additionalProperties": False})
    tok = cache._tokenizer
    req = _req(spec, cache)
    m = req.grammar.matcher
    for t in tok('{"s": "ab', add_special_tokens=False).input_ids:
        assert m.accept_token(t)
    bm = fill_bitmask(expand([(req, [])]), 262144)
    allowed = ((bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1).bool()
    texts = tok.batch_decode([[i] for i in range(262144)])
    ctrl = [i for i, t in enumerate(texts) if any(ord(ch) < 32 for ch in t)]
    assert len(ctrl) > 10 and not allowed[ctrl].any(), [texts[i] for i in ctrl if allowed[i]][:5]
    plain = [i for i in tok("cd", add_special_tokens=False).input_ids]
    assert allowed[plain[0]]
    for t in tok('cd"}', add_special_tokens=False).input_ids:  # 4 characters: the string may close
        assert m.accept_token(t)
    assert m.accept_token(1) and m.is_terminated()


def test_narrowed_json_grammar_keeps_every_other_rule() -> None:
    """json_schema_ebnf's EBNF parses back and keeps what xgrammar's own grammar enforces beside
    the bounded strings: a pattern, a format, number bounds, a $ref, anyOf, array items; and a
    schema without a bounded string compiles as xgrammar has it (None)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"type": "object", "required": ["p", "s", "n", "e", "u", "r", "a"], "properties": {
        "p": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "s": {"type": "string", "minLength": 1,
                                                                 "maxLength": 3},
        "n": {"type": "number", "minimum": 0.5, "maximum": 2.5}, "e": {"type": "string", "format": "email"},
        "u": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer"}]}, "r": {"$ref": "#/$defs/R"},
        "a": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2}},
        "$defs": {"R": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}}}
    g = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(schema)))
    good = {"p": "abc", "s": "ab", "n": 1.5, "e": "a@b.co", "u": 7, "r": {"x": True}, "a": ["q"]}
    assert accepts(g, json.dumps(good))
    for key, bad in (("p", "ABC"), ("s", ""), ("s", "abcd"), ("s", "a\tb"), ("n", 3), ("e", "nope"),
                     ("u", "abc"), ("u", "\t"), ("r", {"x": 1}), ("a", ["a", "b", "c"]), ("a", ["\n"])):
        text = json.dumps({**good, key: bad}).replace("\\t", "\t").replace("\\n", "\n")  # raw, unescaped
        assert not accepts(g, text), (key, bad)
    assert json_schema_ebnf(json.dumps({"type": "object", "properties": {"s": {"type": "string"}}})) is None


def test_bad_specs_fail_compile_with_a_message(cache: GrammarCache) -> None:
    for spec, word in [(StructuredOutputs(regex="(ab"), "regex"),
                       (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar"),
                       (StructuredOutputs(json={"type": "nonsense"}), "json")]:
        with pytest.raises(ValueError, match=word):
            cache.submit(spec).result()
    with pytest.raises(ValueError):
        StructuredOutputs(regex="a", choice=["b"])  # two constraints
    with pytest.raises(ValueError):
        StructuredOutputs(choice=[])
    # One compile per distinct spec: the same schema (any key order) shares a future.
    a = cache.submit(StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "string"}}}))
    b = cache.submit(StructuredOutputs(json={"properties": {"x": {"type": "string"}}, "type": "object"}))
    assert a is b
