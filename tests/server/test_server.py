"""A real `flatserve serve` on 127.0.0.1, driven by the official openai client and raw HTTP."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from flatserve.bench.serve import wait_healthy

KEY = "test-key-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    # The log goes to a file: a pipe nobody reads fills at 64 KiB and stalls the server.
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flatserve.cli", "serve", "--device", "cpu", "--port", str(port), "--api-key", KEY,
         "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--max-num-seqs", "32",
         "--served-model-name", "gemma-test"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    yield {"url": url, "proc": proc}
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


def _client(server):
    import openai

    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


def _hdr() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _metric(server, name: str) -> float:
    text = httpx.get(server["url"] + "/metrics", headers=_hdr()).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_completions_stream_equals_non_stream_with_usage(server) -> None:
    c = _client(server)
    kw = dict(model="gemma-test", prompt="The capital of France is", max_tokens=20,
              temperature=0.8, seed=11)
    full = c.completions.create(**kw)
    assert full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert full.usage.prompt_tokens == 6  # <bos> + 5 words


def test_chat_stream_and_non_stream(server) -> None:
    c = _client(server)
    kw = dict(model="gemma-test", messages=[{"role": "user", "content": "Say hi"}],
              max_tokens=12, temperature=0.7, seed=3)
    full = c.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_logprobs_echo_stop(server) -> None:
    c = _client(server)
    r = c.completions.create(model="gemma-test", prompt="Once upon a time", max_tokens=8, n=2,
                             temperature=1.0, seed=5, logprobs=3)
    assert [ch.index for ch in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    e = c.completions.create(model="gemma-test", prompt="Once upon a time", max_tokens=4,
                             temperature=0, echo=True)
    assert e.choices[0].text.startswith("Once upon a time")
    base = c.completions.create(model="gemma-test", prompt="Once upon a time", max_tokens=12,
                                temperature=0).choices[0].text
    word = base.split()[1]
    s = c.completions.create(model="gemma-test", prompt="Once upon a time", max_tokens=12,
                             temperature=0, stop=[word])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == base[:base.index(word)]
    ch = c.chat.completions.create(model="gemma-test", messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=4, logprobs=True, top_logprobs=2, temperature=0)
    assert len(ch.choices[0].logprobs.content[0].top_logprobs) == 2


def test_32_concurrent_streams_complete_then_no_blocks_used(server) -> None:
    c = _client(server)
    results: list = [None] * 32

    def run(i: int) -> None:
        chunks = list(c.completions.create(model="gemma-test", prompt=f"Story number {i}:" * (1 + i % 5),
                                           max_tokens=16, temperature=0.5, seed=i, stream=True,
                                           stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        results[i] = (text, chunks[-1].usage)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for text, usage in results:
        assert usage.completion_tokens >= 1 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert _metric(server, "flatserve_kv_blocks_used") == 0


def test_disconnect_mid_stream_frees_blocks(server) -> None:
    for _ in range(4):
        with httpx.stream("POST", server["url"] + "/v1/completions", headers=_hdr(), timeout=30,
                          json={"prompt": "Tell a long story", "max_tokens": 500, "stream": True,
                                "ignore_eos": True}) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 3:
                    break  # drop the connection mid-stream
    with httpx.Client(timeout=30) as cl:  # a non-streaming client that gives up
        try:
            cl.post(server["url"] + "/v1/completions", headers=_hdr(), timeout=0.5,
                    json={"prompt": "Hello", "max_tokens": 500, "ignore_eos": True})
        except httpx.ReadTimeout:
            pass
    deadline = time.time() + 1.5
    while time.time() < deadline and _metric(server, "flatserve_kv_blocks_used") > 0:
        time.sleep(0.05)
    assert _metric(server, "flatserve_kv_blocks_used") == 0


BAD = [
    ("/v1/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", {}, 400, "missing required parameter 'prompt'"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "'n'"),
    ("/v1/completions", {"prompt": "x", "n": 100}, 400, "'n'"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "unsupported parameter 'best_of'"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "unsupported parameter 'suffix'"),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400, "prompt is empty"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "prompt is empty"),
    ("/v1/completions", {"prompt": [99999999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "word " * 2000}, 400, "maximum context length is 1024"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1023}, 400, "1025 tokens (2 in the prompt, 1023"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [],
                              "tool_choice": "required"}, 400, "needs a non-empty 'tools' list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs requires logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "image_url"),
    ("/v1/nope", {}, 404, "Not Found"),
]


def test_bad_inputs_answered_in_openai_shape_and_server_still_serves(server) -> None:
    for path, body, status, needle in BAD:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server["url"] + path, headers={**_hdr(), "Content-Type": "application/json"},
                       timeout=30, **kw)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert needle in err["message"], (needle, err["message"])
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    r = httpx.post(server["url"] + "/v1/completions", headers={**_hdr(), "Content-Type": "application/json"},
                   content=big, timeout=30)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    ok = _client(server).completions.create(model="gemma-test", prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    assert _metric(server, "flatserve_kv_blocks_used") == 0


def test_auth_and_open_routes(server) -> None:
    u = server["url"]
    assert httpx.get(u + "/health").status_code == 200
    for h in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(u + "/v1/models", headers=h)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(u + "/v1/models", headers=_hdr())
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "gemma-test"
    assert httpx.get(u + "/version", headers=_hdr()).json()["version"]
    text = httpx.get(u + "/metrics", headers=_hdr()).text
    for name in ("flatserve_num_requests_running", "flatserve_num_requests_waiting",
                 "flatserve_kv_blocks_total", "flatserve_num_preemptions_total",
                 "flatserve_prompt_tokens_total", "flatserve_generation_tokens_total",
                 "flatserve_time_to_first_token_seconds_bucket",
                 "flatserve_inter_token_latency_seconds_bucket",
                 "flatserve_e2e_request_latency_seconds_bucket", 'flatserve_memory_budget_bytes{term="weights"}',
                 # the default GGUF's stored Q4_K_M mix, served in place
                 'flatserve_weight_bytes{format="q4_k"}', 'flatserve_weight_linears{format="q6_k"}'):
        assert name in text, name


def test_sigterm_mid_stream_ends_streams_and_exits_zero(default_model_path) -> None:
    sigterm_mid_stream([])


def sigterm_mid_stream(extra: list[str]) -> None:
    """A server (with `extra` flags) stopped by SIGTERM while a stream runs: the stream ends
    with finish_reason "abort" and [DONE], the process exits 0."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flatserve.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--kv-cache-memory", "128MiB", "--max-model-len", "512",
                             "--max-num-batched-tokens", "256",
                             "--shutdown-timeout", "0", *extra],  # no drain: abort at once
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    lines: list[str] = []

    def consume() -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": "Go", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGTERM)

    t = threading.Thread(target=consume)
    t.start()
    t.join(timeout=60)
    assert proc.wait(timeout=30) == 0
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert data[-1]["choices"][0]["finish_reason"] == "abort"
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    out = proc.stdout.read()
    assert "flatserve 0.1.0: model" in out and "KV " in out and f"http://127.0.0.1:{port}" in out
    assert "weights q4_k x " in out and "q6_k x " in out and " MiB" in out  # formats, bytes
