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
