"""Structured outputs and tools through a real `flatserve serve` and the official openai client:
20+ JSON schemas at temperature 1.0 (sync and streaming) always give schema-valid JSON; tool
calls with required/named choices always parse and validate; bad input is a 400, never a 500."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from flatserve.bench.serve import wait_healthy
from tests.server.test_server import _free_port

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

KEY = "k-struct"
# Bounded leaves (maxLength, enums, ranges, maxItems) keep a 270M base model at temperature 1.0
# inside max_tokens; the grammar guarantees the shape, the bound guarantees it finishes.
S = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4}},
     "required": ["xs"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": S},
        "required": ["id", "name"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 10, "maximum": 20},
                                      "b": {"enum": ["x", "y"]}, "c": {"type": "boolean"}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                                "items": {"type": "object", "properties": {
                                                    "sku": S, "qty": {"type": "integer", "minimum": 1,
                                                                      "maximum": 9}},
                                                    "required": ["sku", "qty"],
                                                    "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}}, "required": ["status"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0,
                                                       "maximum": 9}, {"type": "null"}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"point": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 2}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900,
                                                           "maximum": 2030}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}},
     "required": ["level"], "additionalProperties": False},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {
        "k": {"enum": ["a", "b"]}, "deep": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["n"],
            "additionalProperties": False}}, "required": ["k", "deep"],
        "additionalProperties": False}}, "required": ["meta"], "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
                                                "maxItems": 3}},
     "required": ["flags"], "additionalProperties": False},
    # xgrammar drops minLength/maxLength on a string that has a pattern (a 17-letter word came
    # back for maxLength 5, 2026-11-25): the bounds go in the pattern (README, structured outputs).
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
     "required": ["word"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0,
                                            "maximum": 50}, "s": S},
     "required": ["n"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"],
                                                "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Answer as JSON."}]


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    # The log goes to a file: a pipe nobody reads fills at 64 KiB and stalls the server.
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    port = _free_port()
    # Torch kernels only: the test is about grammars, not the C++ attention/fused paths.
    proc = subprocess.Popen(
        [sys.executable, "-m", "flatserve.cli", "serve", "--port", str(port), "--api-key", KEY,
         "--device", "cpu", "--attention-backend", "torch", "--kv-cache-memory", "256MiB",
         "--max-model-len", "1024", "--max-num-batched-tokens", "256",
         "--max-num-seqs", "16", "--max-num-batched-tokens", "512", "--served-model-name",
         "gemma-test", "--seed", "3"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=900)  # a loaded 2-core box: start-up can take minutes
    except BaseException:
        proc.kill()
        raise
    yield {"url": url, "proc": proc}
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def _client(server):
    import openai

    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=600)


def _rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_json_schemas_sync_and_streaming_always_valid(server) -> None:
    c = _client(server)

    def sync(schema: dict) -> None:
        r = c.chat.completions.create(model="gemma-test", messages=MSGS, temperature=1.0,
                                      max_tokens=96, response_format=_rf(schema))
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)

    def stream(schema: dict) -> None:
        text, reason = "", None
        for ch in c.chat.completions.create(model="gemma-test", messages=MSGS, temperature=1.0,
                                            max_tokens=96, response_format=_rf(schema), stream=True):
            for x in ch.choices:
                text += x.delta.content or ""
                reason = x.finish_reason or reason
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)

    with ThreadPoolExecutor(8) as pool:  # concurrent: masks of many grammars in one flat step
        list(pool.map(sync, SCHEMAS))
        list(pool.map(stream, SCHEMAS))


def test_completions_json_object_regex_choice_grammar(server) -> None:
    c = _client(server)
    r = c.completions.create(model="gemma-test", prompt="A JSON object:", max_tokens=64,
                             temperature=1.0, extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    r = c.completions.create(model="gemma-test", prompt="Phone:", max_tokens=16, temperature=1.0,
                             extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert __import__("re").fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = c.chat.completions.create(model="gemma-test", messages=MSGS, max_tokens=8, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].message.content in ("alpha", "beta")
    gbnf = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    r = c.completions.create(model="gemma-test", prompt="x", max_tokens=12, temperature=1.0,
                             extra_body={"structured_outputs": {"grammar": gbnf}})
    if r.choices[0].finish_reason == "stop":
        assert __import__("re").fullmatch(r"\(\d+\)", r.choices[0].text)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_parse_and_validate(server, stream: bool) -> None:
    c = _client(server)
    msgs = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    params = {WEATHER["function"]["name"]: WEATHER["function"]["parameters"],
              ADD["function"]["name"]: ADD["function"]["parameters"]}
    for choice in ["required", {"type": "function", "function": {"name": "add"}}] * 3:
        kw = dict(model="gemma-test", messages=msgs, tools=[WEATHER, ADD], tool_choice=choice,
                  temperature=1.0, max_tokens=120, parallel_tool_calls=False)
        if stream:
            calls: dict[int, dict] = {}
            reason = None
            for ch in c.chat.completions.create(**kw, stream=True):
                for x in ch.choices:
                    reason = x.finish_reason or reason
                    for tc in x.delta.tool_calls or []:
                        d = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
                        d["id"] = tc.id or d["id"]
                        d["name"] += (tc.function.name or "") if tc.function else ""
                        d["args"] += (tc.function.arguments or "") if tc.function else ""
            got = [(d["id"], d["name"], d["args"]) for _, d in sorted(calls.items())]
        else:
            r = c.chat.completions.create(**kw)
            reason = r.choices[0].finish_reason
            got = [(t.id, t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
        assert reason == "tool_calls" and len(got) == 1
        cid, name, args = got[0]
        assert cid.startswith("call_")
        if isinstance(choice, dict):
            assert name == "add"
        jsonschema.validate(json.loads(args), params[name])


def test_tool_results_go_back_through_the_template(server) -> None:
    c = _client(server)
    msgs = [{"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add",
                                                                  "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = c.chat.completions.create(model="gemma-test", messages=msgs, tools=[ADD], max_tokens=8,
                                  temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_structured_and_tool_inputs_are_400_and_server_still_serves(server) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    url = server["url"] + "/v1/chat/completions"
    bad = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": {"type": "nonsense"}}}},
        {"response_format": {"type": "json_schema"}},
        {"structured_outputs": {"regex": "(unclosed"}},
        {"structured_outputs": {"grammar": "root ::= missing_rule"}},
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
    ]
    for extra in bad:
        r = httpx.post(url, headers=h, timeout=120, json={"model": "gemma-test", "messages": MSGS,
                                                          "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
    r = httpx.post(url, headers=h, timeout=120, json={"model": "gemma-test", "messages": MSGS,
                                                      "max_tokens": 4})
    assert r.status_code == 200


def test_tool_setup_refuses_a_template_without_tools() -> None:
    from flatserve.server import routes
    from flatserve.server.app import APIError
    from flatserve.server.protocol import ChatRequest

    req = ChatRequest(messages=MSGS, tools=[ADD])
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(APIError) as e:
        routes._tool_setup(SimpleNamespace(template=plain), req)
    assert e.value.status == 400 and e.value.param == "tools"
    from flatserve.engine.chat import CHATML, GEMMA, LLAMA3

    for t in (GEMMA, CHATML, LLAMA3):
        assert routes._tool_setup(SimpleNamespace(template=t), req)[0] == "auto"
