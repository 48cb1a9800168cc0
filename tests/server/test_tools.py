"""tool_choice "auto": the model's own tool-call syntax parsed out of its text (Hermes/Qwen,
Llama 3, Mistral), streamed as OpenAI does (content first, then one chunk naming each call and one
with its arguments), and the grammar of "required"/named choices. Random arguments, random text
around the calls and random stream cut points on every run."""
from __future__ import annotations

import json
import random
import string

import jsonschema
import pytest

from flatserve.server import tools
from flatserve.server.tools import HERMES, LLAMA3, MISTRAL, ToolStreamer

NAMES = {"get_weather", "search"}


def _args(rng: random.Random) -> dict:
    word = "".join(rng.choice(string.ascii_letters + " é\"\\") for _ in range(rng.randint(0, 12)))
    return {"city": word, "days": rng.randint(0, 9), "hourly": rng.random() < 0.5}


def _written(fmt: str, calls: list[tuple[str, dict]], rng: random.Random) -> str:
    """How a model of each family writes these calls."""
    if fmt == HERMES:
        return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n"
                       for n, a in calls)
    if fmt == MISTRAL:
        if rng.random() < 0.5:  # v3 tokenizer: one JSON list
            return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    tag = "<|python_tag|>" if rng.random() < 0.5 else ""  # Llama 3.1 / 3.2 JSON calls
    return tag + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def _expect(calls: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return [(n, a) for n, a in calls if n in NAMES]


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, LLAMA3])
@pytest.mark.parametrize("seed", range(5))
def test_auto_parses_each_format_with_content_before(fmt: str, seed: int) -> None:
    rng = random.Random()
    calls = [(rng.choice(sorted(NAMES)), _args(rng)) for _ in range(rng.randint(1, 3))]
    lead = "" if fmt == LLAMA3 else rng.choice(["", "Let me check that. "])  # Llama 3: JSON only
    content, got = tools.parse_auto(lead + _written(fmt, calls, rng), [fmt], NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert content == (lead.strip() or None)
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


def test_auto_drops_unknown_names_and_keeps_plain_text() -> None:
    rng = random.Random()
    text = _written(HERMES, [("launch_rockets", _args(rng)), ("search", {"q": "x"})], rng)
    content, got = tools.parse_auto(text, [HERMES], NAMES)
    assert [c.name for c in got] == ["search"]
    for plain in ["The weather is fine.", '{"answer": 42}', "<tool_call>not json</tool_call>", ""]:
        assert tools.parse_auto(plain, [], NAMES) == (plain, [])


def test_formats_come_from_the_template() -> None:
    assert tools.template_formats("{{ messages }}") is None  # never reads tools: refused (400)
    assert tools.template_formats("{% if tools %}<tool_call>{% endif %}") == [HERMES]
    assert tools.template_formats("{% for t in tools %}[TOOL_CALLS]{% endfor %}") == [MISTRAL]
    assert tools.template_formats('{{ tools }} "parameters": ') == [LLAMA3]
    assert tools.template_formats("{{ tools | tojson }}") == []  # takes tools, names no format


def _stream(streamer: ToolStreamer, text: str, rng: random.Random, reason: str
            ) -> tuple[list[dict], str | None]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    deltas: list[dict] = []
    for a, b in zip([0] + cuts, cuts):
        out, r = streamer.feed(text[a:b], None)
        assert r is None
        deltas += out
    out, r = streamer.feed(text[cuts[-1]:], reason)
    return deltas + out, r


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL])
@pytest.mark.parametrize("seed", range(4))
def test_auto_stream_sends_content_then_whole_calls(fmt: str, seed: int) -> None:
    """No byte of a call goes out as content, even when a marker is cut between chunks."""
    rng = random.Random()
    calls = [(rng.choice(sorted(NAMES)), _args(rng)) for _ in range(rng.randint(1, 2))]
    lead = "Checking the forecast now. "
    deltas, reason = _stream(ToolStreamer("auto", [fmt], NAMES), lead + _written(fmt, calls, rng),
                             rng, "stop")
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip() == lead.strip() and "<" not in content and "[" not in content
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    bodies = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert [h["function"]["name"] for h in heads] == [n for n, _ in calls]
    assert [h["index"] for h in heads] == [b["index"] for b in bodies] == list(range(len(calls)))
    assert [json.loads(b["function"]["arguments"]) for b in bodies] == [a for _, a in calls]
    assert reason == "tool_calls"


def test_auto_stream_without_calls_is_all_content() -> None:
    rng = random.Random()
    text = "".join(rng.choice(string.ascii_letters + " .,<[{") for _ in range(rng.randint(20, 80)))
    deltas, reason = _stream(ToolStreamer("auto", [HERMES, MISTRAL], NAMES), text, rng, "length")
    assert "".join(d.get("content") or "" for d in deltas) == text and reason == "length"


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_grammar_schema_takes_valid_calls_only(parallel: bool) -> None:
    rng = random.Random()
    params = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    ts = [{"type": "function", "function": {"name": n, "parameters": params}} for n in sorted(NAMES)]
    schema = tools.forced_spec(ts, None, parallel).json
    one = {"name": "search", "arguments": {"city": "Oslo", "days": rng.randint(0, 9)}}
    jsonschema.validate([one], schema)
    bad = [[], [{"name": "launch", "arguments": {"city": "x"}}],
           [{"name": "search", "arguments": {"days": 1}}],
           [{"name": "search", "arguments": {"city": "x", "extra": 1}}]]
    for b in bad + ([] if parallel else [[one, one]]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(b, schema)
    named = tools.forced_spec(ts, "get_weather", True).json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([one], named)  # a named choice allows that function only
    got = tools.parse_forced(json.dumps([one]))
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(one["name"], one["arguments"])]
    assert tools.parse_forced('[{"name": "search", "argum') is None  # cut by max_tokens
