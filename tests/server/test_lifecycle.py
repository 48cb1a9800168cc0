"""The server's life under faults and signals, on a tiny random-weight model (fast to start).

- An error that leaves the engine's state unknown (injected into the forward) stops it: the
  requests in flight and later ones get an immediate 503, /health 503, and the process exits 1.
- SIGTERM under load drains: new requests 503, in-flight ones finish for up to
  --shutdown-timeout, the rest end with finish_reason "abort" (streaming or not), exit 0.
- A second SIGINT exits at once.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server import live

POISON = 77  # a prompt token id that makes the injected forward raise

# Armed by a request whose prompt ends in three POISON ids (start-up's profile steps run
# arbitrary ids through the forward too); then the next forward raises a device fault.
FAULT = f"""
from flatserve.engine.engine import Engine
from flatserve.runner import ModelRunner
_add, _fwd = Engine.add_request, ModelRunner.forward_hidden
def _arm(self, prompt, params, request_id=None):
    if list(prompt)[-3:] == [{POISON}] * 3:
        ModelRunner.armed = True
    return _add(self, prompt, params, request_id)
def _fault(self, batch):
    if getattr(ModelRunner, "armed", False):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    return _fwd(self, batch)
Engine.add_request, ModelRunner.forward_hidden = _arm, _fault
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return live.tiny_model(tmp_path_factory.mktemp("life"))


def _args(path) -> list[str]:
    return [str(path), "--dtype", "float32", "--max-model-len", "2048",
            "--num-gpu-blocks-override", "400", "--max-num-seqs", "32"]


def test_engine_fault_stops_the_server_with_503s_and_exit_1(tiny) -> None:
    proc, url = live.start(_args(tiny), prelude=FAULT)
    try:
        got: dict[str, object] = {}

        def long_stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
                got["lines"] = [x for x in r.iter_lines() if x]

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(1.0)
        r = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": [5] + [POISON] * 3, "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "server_error"
        t.join(timeout=60)
        lines = got["lines"]
        assert lines[-1] == "data: [DONE]" and '"service_unavailable"' in lines[-2], lines[-3:]
        later = []
        for _ in range(3):  # until the process is gone: 503 or connection refused, never a hang
            try:
                later.append(httpx.post(url + "/v1/completions", timeout=10,
                                        json={"prompt": [5], "max_tokens": 1}).status_code)
                later.append(httpx.get(url + "/health", timeout=10).status_code)
            except httpx.TransportError:
                later.append("gone")
        assert set(later) <= {503, "gone"}, later
        assert proc.wait(timeout=60) == 1
        assert "engine stopped" in live.output(proc)
    finally:
        proc.kill()


def _client(url: str, i: int, stream: bool, max_tokens: int, out: list) -> None:
    body = {"prompt": [5 + i, 6, 7], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    try:
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines()
                          if x.startswith("data: {")]
                done = r.status_code == 200
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            out[i] = ("stream", max_tokens, chunks[-1]["choices"][0]["finish_reason"], text, done)
        else:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            c = r.json()["choices"][0]
            out[i] = ("full", max_tokens, c["finish_reason"], r.json()["usage"]["completion_tokens"],
                      r.status_code == 200)
    except Exception as e:  # recorded: the assertions below name it
        out[i] = ("error", max_tokens, repr(e), None, False)


def test_sigterm_under_load_drains_then_aborts_and_exits_0(tiny) -> None:
    proc, url = live.start(_args(tiny) + ["--shutdown-timeout", "3"])
    try:
        n = 12
        out: list = [None] * n
        # Short requests finish inside the drain window (given the CPU); 1,900-token ones cannot.
        plan = [(i % 2 == 0, 4 if i % 3 == 0 else 1900) for i in range(n)]
        ts = [threading.Thread(target=_client, args=(url, i, s, m, out)) for i, (s, m) in enumerate(plan)]
        [t.start() for t in ts]
        deadline = time.time() + 60
        # every request received (3 prompt tokens each) before the signal: a client thread the
        # busy box had not yet run would post after it and be refused (seen under CI's 2 workers)
        while (live.metric(url, "flatserve_prompt_tokens_total") < 3 * n
               or live.metric(url, "flatserve_num_requests_running") < 8) and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        [t.join(timeout=90) for t in ts]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    for kind, max_tokens, reason, got, ok in out:
        assert kind != "error" and ok, (kind, reason)
        assert reason in ("length", "abort"), (kind, reason)  # never null, never cut
        if reason == "length":  # a full answer
            assert kind == "stream" or got == max_tokens
    # 1,900 tokens cannot finish in a 3 s drain; a short one may be aborted too where the box is
    # so busy that it was still queued (seen at load 120 on the 2-core dev box).
    assert all(o[2] == "abort" for o in out if o[1] == 1900)


def test_second_sigint_exits_at_once(tiny) -> None:
    proc, url = live.start(_args(tiny) + ["--shutdown-timeout", "60"])
    try:
        out: list = [None]
        t = threading.Thread(target=_client, args=(url, 0, True, 1900, out))
        t.start()
        deadline = time.time() + 60
        while live.metric(url, "flatserve_num_requests_running") < 1 and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # draining: the request may run for 60 s
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130 and time.time() - t0 < 5
        t.join(timeout=30)
    finally:
        proc.kill()
