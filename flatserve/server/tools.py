"""OpenAI tools: the grammar for `required`/named choices, and parsers for the model's own formats.

`required` and a named choice constrain the output to a JSON array of calls,
`[{"name": ..., "arguments": {...}}]`, each call's arguments valid against its function's
parameter schema (as vLLM does). `auto` lets the model write its own tool-call syntax, which is
parsed after the fact: Hermes/Qwen `<tool_call>{json}</tool_call>`, Llama 3 JSON
(`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`), Mistral
`[TOOL_CALLS] [...]` (or `[TOOL_CALLS]name[ARGS]{...}`). A chat template declares its format by
the markers it writes; a template that never reads `tools` cannot take them.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from flatserve.engine.sampling_params import StructuredOutputs

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_MARKERS = {HERMES: "<tool_call>", MISTRAL: "[TOOL_CALLS]", LLAMA3: "<|python_tag|>"}


@dataclass(slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def template_formats(template: str) -> list[str] | None:
    """The tool-call formats a chat template declares; [] when it takes tools but names none
    (every parser is tried); None when it takes no tools at all."""
    if not re.search(r"\btools\b", template):
        return None
    found = [f for f, m in _MARKERS.items() if m in template]
    if not found and ('"parameters"' in template or "'parameters'" in template):
        found = [LLAMA3]
    return found


def forced_spec(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> StructuredOutputs:
    """The grammar of `required` (any tool; name=None) or a named choice: a JSON array of calls."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in fns]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel or name is not None:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


def parse_forced(text: str) -> list[Call] | None:
    """The calls of a `required`/named output; None when it does not parse (cut by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [Call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items
            if isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c]


def tool_start(text: str, formats: list[str]) -> int:
    """Where a tool call starts (or may be starting, at the end of a stream) in `text`; len(text)
    when none can. Text before it is plain content and safe to stream."""
    fmts = formats or [HERMES, MISTRAL, LLAMA3]
    best = len(text)
    for f in fmts:
        m = _MARKERS[f]
        i = text.find(m)
        if i >= 0:
            best = min(best, i)
            continue
        for k in range(min(len(m) - 1, len(text)), 0, -1):  # a marker cut by the stream's end
            if text.endswith(m[:k]):
                best = min(best, len(text) - k)
                break
    if LLAMA3 in fmts and text.lstrip().startswith("{"):
        best = min(best, len(text) - len(text.lstrip()))
    return best


def parse_auto(text: str, formats: list[str], names: set[str]) -> tuple[str | None, list[Call]]:
    """-> (content before the calls or None, the calls). No calls: the text is all content."""
    start, calls = _find_calls(text, formats, names)
    if calls:
        return text[:start].strip() or None, calls
    return text, []


def _find_calls(text: str, formats: list[str], names: set[str]) -> tuple[int, list[Call]]:
    """-> (where the calls start, the calls of the first format that has any)."""
    for f in formats or [HERMES, MISTRAL, LLAMA3]:
        calls, start = _PARSERS[f](text)
        calls = [c for c in calls if c.name in names]
        if calls:
            return start, calls
    return len(text), []


def _hermes(text: str) -> tuple[list[Call], int]:
    start = text.find("<tool_call>")
    if start < 0:
        return [], 0
    calls = []
    for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text[start:], re.S):
        calls += _from_json(body)
    return calls, start


def _mistral(text: str) -> tuple[list[Call], int]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return [], 0
    rest = text[start + len("[TOOL_CALLS]"):].strip()
    if "[ARGS]" in rest:  # newer format: name[ARGS]{...} per call
        calls = []
        for part in rest.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            try:
                calls.append(Call(name.strip(), json.dumps(json.loads(args), ensure_ascii=False)))
            except ValueError:
                pass
        return calls, start
    return _from_json(rest), start


def _llama3(text: str) -> tuple[list[Call], int]:
    body = text.strip()
    start = len(text) - len(text.lstrip())
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    calls: list[Call] = []
    for part in body.split(";"):  # Llama 3.2 separates several calls with ';'
        calls += _from_json(part.strip())
    return calls, start


def _from_json(body: str) -> list[Call]:
    try:
        obj = json.loads(body)
    except ValueError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for c in items:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            continue
        args = c.get("arguments", c.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            try:
                args = json.loads(args)
            except ValueError:
                continue
        calls.append(Call(c["name"], json.dumps(args, ensure_ascii=False)))
    return calls


_PARSERS = {HERMES: _hermes, MISTRAL: _mistral, LLAMA3: _llama3}


def template_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what chat templates read: tool-call arguments as objects, not text."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except (ValueError, TypeError):
                    pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


class ToolStreamer:
    """One streamed choice of a chat with tools: which text may go out as content now, and the
    `delta.tool_calls` chunks once the calls are whole (OpenAI: one chunk naming each call, then
    its arguments). `mode`: "forced" (required/named: the whole output is calls) or "auto"."""

    def __init__(self, mode: str, formats: list[str], names: set[str]) -> None:
        self.mode, self.formats, self.names = mode, formats, names
        self.text, self.sent = "", 0

    def feed(self, new: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """-> the deltas to send now, and the finish reason (None while running)."""
        self.text += new
        if reason is None:
            if self.mode == "forced":
                return [], None
            cut = tool_start(self.text, self.formats)
            if cut <= self.sent:
                return [], None
            out = [{"content": self.text[self.sent:cut]}]
            self.sent = cut
            return out, None
        rest = self.text[self.sent:]
        if self.mode == "forced":
            calls = parse_forced(rest) if reason == "stop" else None
            content = None if calls else rest
        else:  # the rest continues streamed content: only its end is trimmed (a chunk may
            # have ended on the space between two words)
            start, calls = _find_calls(rest, self.formats, self.names)
            content = (rest[:start].rstrip() if self.sent else rest[:start].strip()) if calls else rest
        out = [{"content": content}] if content else []
        for i, c in enumerate(calls or []):
            out.append({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                        "function": {"name": c.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
        return out, "tool_calls" if calls else reason
