"""Bad input of every kind against a live `flatserve serve` (a tiny random-weight Qwen3 with a
512-token vocabulary, fast to start; validation does not depend on the model): each gets a 4xx
in OpenAI's error shape naming the field, no 500, and the server serves a good request right
after with no KV block held. The cases of issue #29 first, then more kinds (types, ranges,
unicode, JSON depth, sizes, methods, headers, slow clients)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from flatserve.server import guard
from tests.conftest import VOCAB  # the tiny model's: ids from VOCAB up are outside it
from tests.server import live

KEY = "k-robust"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = live.tiny_model(tmp_path_factory.mktemp("bad"))
    proc, url = live.start([str(path), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                            "--max-model-len", "1024", "--served-model-name", "tiny"], key=KEY)
    yield url
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def _strict(text: str):
    """json.loads that refuses NaN/Infinity (Python's accepts them; JSON does not)."""
    def bad(c: str):
        raise ValueError(f"non-JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def _good(url: str) -> None:
    r = httpx.post(url + "/v1/completions", headers=H, timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    deadline = time.time() + 5
    while live.metric(url, "flatserve_kv_blocks_used", H) > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert live.metric(url, "flatserve_kv_blocks_used", H) == 0
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def _assert_error(r: httpx.Response, status: int, param: str | None = None, needle: str = "") -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    err = _strict(r.text)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param or param in err["message"], err
    assert needle in err["message"], err


C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
ISSUE = [  # issue #29's defects 1, 2 and 4
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"262144": 1}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"999999": 1}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"-300000": 1}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"99999999999999999999999": 1}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"-1": 100}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"²": 1}}, "logit_bias"),
    (C, {"prompt": "Hello", "max_tokens": 4, "top_k": 1e30, "temperature": 0.7}, "top_k"),
    (C, {"prompt": "Hello", "max_tokens": 4, "stream": True, "logit_bias": {"262144": 1}}, "logit_bias"),
    (C, {"prompt": "a\ud800b", "max_tokens": 4}, "prompt"),
    (C, {"prompt": ["ok", "a\udfffb"], "max_tokens": 4}, "prompt.1"),
    (C, {"prompt": "Hello", "model": "\ud800"}, "model"),
    (C, {"prompt": "Hello", "stop": ["\ud800"]}, "stop"),
    (C, {"prompt": "Hello", "user": "x\udc00"}, "user"),
    (CH, {"messages": [{"role": "user", "content": "hi \ud83d"}]}, "messages.0.content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
]
MORE = [  # types, ranges, sizes
    (C, {"prompt": {"a": 1}}, "prompt"),
    (C, {"prompt": [1.5, 2]}, "prompt"),
    (C, {"prompt": [[1, 2], [3, -4]]}, "prompt"),
    (C, {"prompt": [VOCAB]}, "prompt"),
    (C, {"prompt": "x", "max_tokens": [1]}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "x", "temperature": 1e400}, "temperature"),
    (C, {"prompt": "x", "top_p": -0.0}, "top_p"),
    (C, {"prompt": "x", "min_p": -1}, "min_p"),
    (C, {"prompt": "x", "stream": "maybe"}, "stream"),  # pydantic takes "yes" as true
    (C, {"prompt": "x", "n": 17}, "n"),
    (C, {"prompt": "x", "n": 2**70}, "n"),
    (C, {"prompt": "x", "logprobs": -1}, "logprobs"),
    (C, {"prompt": "x", "logprobs": 10**20}, "logprobs"),
    (C, {"prompt": "x", "min_tokens": 50, "max_tokens": 4}, "min_tokens"),
    (C, {"prompt": "x", "seed": 1e400}, "seed"),
    (C, {"prompt": "x", "seed": "abc"}, "seed"),
    (C, {"prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": "big"}}, "logit_bias"),
    (C, {"prompt": "x", "stop": [""]}, "stop"),
    (C, {"prompt": "x", "stop": 5}, "stop"),
    (C, {"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options"),
    (CH, {"messages": "hi"}, "messages"),
    (CH, {"messages": [{"role": "user", "content": 5}]}, "content"),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CH, {"messages": MSG, "max_tokens": 10**9}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", ISSUE + MORE,
                         ids=[f"{i}-{b.get('prompt', 'chat')!s:.12}" for i, (_, b, _) in enumerate(ISSUE + MORE)])
def test_bad_value_is_a_400_naming_the_field(url, path, body, param) -> None:
    # ensure_ascii: the lone surrogates go on the wire as JSON escapes, as a client sends them
    r = httpx.post(url + path, headers={**H, "content-type": "application/json"}, timeout=60,
                   content=json.dumps(body, ensure_ascii=True))
    _assert_error(r, 400, param)


def test_issue_defects_then_good_requests(url) -> None:
    """The engine survives every defect of the issue, and a good request follows each."""
    for path, body, _ in ISSUE[:5] + ISSUE[9:12]:
        httpx.post(url + path, headers={**H, "content-type": "application/json"}, timeout=60,
                   content=json.dumps(body))
        _good(url)


def test_clamped_and_reduced_values_are_served(url) -> None:
    """Values in range after clamping are answered: top_k past the vocabulary (2^63) is no
    top_k, seeds of any size reduce deterministically, unicode (emoji, NUL) is text."""
    base = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.8, "ignore_eos": True}
    for extra in ({"top_k": 2**63}, {"top_k": VOCAB}, {"seed": 2**200}, {"seed": -(2**70)},
                  {"prompt": "emoji \U0001f600 and nul \u0000 ok"},
                  {"logit_bias": {str(VOCAB - 1): -100}}):
        r = httpx.post(url + C, headers=H, json={**base, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
    a, b = (httpx.post(url + C, headers=H, timeout=60, json={**base, "seed": 2**200 + 7}).json()
            for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    _good(url)


def test_tiny_repetition_penalty_logprobs_are_valid_json(url) -> None:
    """Defect 3: repetition_penalty 1e-300 with logprobs was a text/plain 500, and streamed a bare NaN."""
    body = {"prompt": "Hello Hello Hello", "max_tokens": 4, "logprobs": 5, "ignore_eos": True,
            "repetition_penalty": 1e-300, "temperature": 0.5, "seed": 1}
    r = httpx.post(url + C, headers=H, json=body, timeout=60)
    assert r.status_code == 200, r.text
    lp = _strict(r.text)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and all(v <= 0 for v in lp["token_logprobs"])
    with httpx.stream("POST", url + C, headers=H, json={**body, "stream": True}, timeout=60) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for x in lines[:-1]:
        _strict(x[6:])
    r = httpx.post(url + CH, headers=H, timeout=60, json={
        "messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 3,
        "repetition_penalty": 1e-300, "temperature": 0})
    assert r.status_code == 200 and _strict(r.text)["choices"][0]["logprobs"]["content"]
    _good(url)


def test_stream_with_bad_value_is_a_400_not_a_cut_stream(url) -> None:
    r = httpx.post(url + C, headers=H, timeout=60, json={
        "prompt": "x", "stream": True, "logit_bias": {"300000": 1}})
    _assert_error(r, 400, "logit_bias")


def _raw(url: str, data: bytes, timeout: float = 30.0, chunks: list[bytes] | None = None) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        for c in chunks or []:
            try:
                s.sendall(c)
            except OSError:
                break  # the server answered (413) and closed: what it sent is still readable
        out = b""
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    break
                out += b
                if b"\r\n\r\n" in out and _complete(out):
                    break
        except (ConnectionResetError, socket.timeout):
            pass
        return out


def _complete(resp: bytes) -> bool:
    head, _, body = resp.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/1.1 ") else -1


def test_malformed_headers_never_500(url) -> None:
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    base = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n")
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    cases = [
        (base + auth + b"X-Odd: caf\xe9 \xff\xfe\r\n\r\n" + body, 200),
        (base + b"Authorization: Bearer \xff\xfe\r\n\r\n" + body, 401),
        (base + b"Authorization: \xff\r\n\r\n" + body, 401),
        (base + b"Authorization: Bearer " + KEY.encode() + b"\xff\r\n\r\n" + body, 401),
        (base.replace(b"application/json", b"application/\xffjson") + auth + b"\r\n" + body, 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: abc\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"Bad Header\r\n\r\n", 400),
        (b"GET /v1/mod\xffels HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n", 400),
    ]
    for raw, status in cases:
        got = _status(_raw(url, raw))
        # h11 itself refuses some of these (400, no body in our shape): never a 500
        assert got == status or (status == 400 and got in (400, 404, 422)), (raw[:80], got)
    _good(url)


def test_methods_depth_and_size(url) -> None:
    for method, path in (("PUT", C), ("DELETE", C), ("GET", C), ("PATCH", CH)):
        r = httpx.request(method, url + path, headers=H, timeout=30)
        _assert_error(r, 405)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(url + C, headers={**H, "content-type": "application/json"}, content=deep, timeout=60)
    _assert_error(r, 400)
    for junk in (b"", b"null", b"[]", b'"x"', b"\xff\xfe", b'{"prompt": "x"} trailing'):
        r = httpx.post(url + C, headers={**H, "content-type": "application/json"}, content=junk, timeout=60)
        _assert_error(r, 400)
    r = httpx.post(url + C, headers=H, json={"prompt": [[5] * 4] * 2000, "max_tokens": 1}, timeout=60)
    _assert_error(r, 400, "prompt", "at most 256 prompts")
    _good(url)


def test_body_cap_enforced_while_reading_chunked_or_not(url) -> None:
    """Defect 6: a 9.7 MiB chunked body was read whole and tokenized; now 413 while reading."""
    def chunks():
        piece = b"a" * (1 << 20)
        yield b'{"prompt": "'
        for _ in range(10):
            yield piece
        yield b'"}'
    t0 = time.time()
    r = httpx.post(url + C, headers={**H, "content-type": "application/json"}, content=chunks(),
                   timeout=60)
    _assert_error(r, 413)
    # Content-Length that lies low is cut at the cap too (h11 reads only what it says): a body
    # over the cap with an honest length is refused before a byte of it is read.
    big = b'{"prompt": "' + b"a" * (guard.MAX_BODY_BYTES + 10) + b'"}'
    r = httpx.post(url + C, headers={**H, "content-type": "application/json"}, content=big, timeout=60)
    _assert_error(r, 413)
    assert time.time() - t0 < 60
    _good(url)


def test_tokenizing_a_big_prompt_does_not_stall_health(url) -> None:
    """Tokenization runs off the event loop: /health answers while a 7 MiB prompt is tokenized."""
    big = {"prompt": "word " * (7 * 2**20 // 5), "max_tokens": 1}
    done = threading.Event()
    res: list = []

    def post() -> None:
        res.append(httpx.post(url + C, headers=H, json=big, timeout=300))
        done.set()

    threading.Thread(target=post).start()
    time.sleep(1.0)  # the body is in; tokenizing runs for seconds on this box
    worst = 0.0
    while not done.is_set():
        t = time.time()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.time() - t)
        time.sleep(0.2)
    _assert_error(res[0], 400, "max_tokens", "maximum context length")
    # Loose: on a saturated 2-core box (load 40-120, 8 helpers) every request waits seconds for
    # CPU; 4.9 s was seen there with tokenization off the loop. The issue's stall was 7.4 s on an
    # idle box; this bound catches the loop being held for the whole tokenization.
    assert worst < 10.0, worst
    _good(url)


def test_slow_clients_are_cut_off(url) -> None:
    """Half-sent headers and half-sent bodies do not hold a connection open forever."""
    results: dict[str, tuple[bytes, float]] = {}

    def slow_headers() -> None:
        t = time.time()
        out = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: 1", timeout=60)
        results["headers"] = (out, time.time() - t)

    def slow_body() -> None:
        t = time.time()
        out = _raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                   + KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: 100"
                   b"\r\n\r\n{\"prompt\":", timeout=60)
        results["body"] = (out, time.time() - t)

    ts = [threading.Thread(target=f) for f in (slow_headers, slow_body)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    out, took = results["headers"]
    assert out == b"" and took < guard.HEADER_DEADLINE_S + 15, (out, took)  # closed, no reply
    out, took = results["body"]
    assert _status(out) == 408 and took < guard.BODY_IDLE_S + 15, (out[:200], took)
    assert b'"request_timeout"' in out
    _good(url)
