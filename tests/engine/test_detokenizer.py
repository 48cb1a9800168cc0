"""Incremental detokenisation and stop strings, with the default model's real tokenizer."""
from __future__ import annotations

import pytest

from flatserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(default_model_path):
    from transformers import AutoTokenizer

    from flatserve.model.loader import gguf_sidecar

    return AutoTokenizer.from_pretrained(str(gguf_sidecar(default_model_path)))


def _feed(tok, text: str, stop: list[str], prompt: str = "Say:"):
    ids = tok(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, tok(prompt).input_ids, stop)
    streamed, hit = "", None
    for i in ids:
        hit = d.add(i)
        vis = d.visible_text(finished=hit is not None)
        assert vis.startswith(streamed), "streamed text is never taken back"
        assert "\ufffd" not in vis, "a multi-byte character was split"
        streamed = vis
        if hit:
            break
    return d.text, hit, ids


def test_round_trip_with_multibyte_characters(tok) -> None:
    text = " Grüße aus Köln 🙂 — 東京タワー, naïve café"
    out, hit, ids = _feed(tok, text, [])
    assert hit is None and out == tok.decode(ids)


def test_stop_string_across_token_boundaries_is_cut(tok) -> None:
    text = " The answer is 42. Observation: done"
    ids = tok(text, add_special_tokens=False).input_ids
    # "Observ" + "ation:" style splits: the stop spans several tokens.
    out, hit, _ = _feed(tok, text, ["ation: d", "zzz"])
    assert hit == "ation: d"
    assert out == " The answer is 42. Observ"
    assert len(ids) > 3


def test_stop_string_earliest_wins_and_can_be_kept(tok) -> None:
    ids = tok(" one two three four", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok, [2], ["three", "two"], include_stop=True)
    for i in ids:
        if d.add(i):
            break
    assert d.text == " one two"


@pytest.mark.parametrize("seed", range(6))
def test_deferred_bulk_decode_equals_token_by_token(tok, seed) -> None:
    """Offline runs read the text once at the end (two decodes per request); streaming reads it
    after every token (two per token). Both must give the same text, byte-fallback tokens and
    multi-byte characters included."""
    import random

    rng = random.Random(seed)
    text = " Grüße aus Köln 🙂 — 東京タワー, naïve café. The answer is 42."
    ids = tok(text, add_special_tokens=False).input_ids
    ids = ids + [rng.randrange(tok.vocab_size) for _ in range(60)] + ids[: rng.randrange(len(ids))]
    prompt = tok("Say:").input_ids
    step, bulk = IncrementalDetokenizer(tok, prompt, []), IncrementalDetokenizer(tok, prompt, [])
    cut = rng.randrange(1, len(ids))  # a streaming read in the middle, then defer the rest
    for i, t in enumerate(ids):
        step.add(t)
        _ = step.text  # read after every token: the streaming path
        bulk.add(t)
        if i == cut:
            _ = bulk.text
    assert bulk.text == step.text
