"""The benchmark harness against a live flatserve, and against a fake endpoint that fails."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from flatserve.bench import datasets
from flatserve.bench.serve import bench, markdown, wait_healthy
from tests.server.test_server import _free_port

MODEL = ""  # the live server's model id, read from /v1/models


@pytest.fixture(scope="module")
def tok(default_model_path):
    from flatserve.cli import _bench_tokenizer

    return _bench_tokenizer(str(default_model_path))


@pytest.fixture(scope="module")
def live(default_model_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flatserve.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                             "--max-num-batched-tokens", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    global MODEL
    MODEL = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    yield url, proc.pid
    proc.terminate()
    proc.wait(timeout=30)


def _gen_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^flatserve_generation_tokens_total ([0-9.e+]+)$", text, re.M).group(1))


@pytest.mark.parametrize("name,n,length", [("random", 4, 57), ("chat", 4, 200), ("agent", 6, 600)])
def test_datasets_exact_and_deterministic(tok, name: str, n: int, length: int) -> None:
    a = datasets.build(name, tok, n, 8, length, seed=3)
    b = datasets.build(name, tok, n, 8, length, seed=3)
    assert a == b and len(a) == n
    for it in a:
        assert len(tok(it.prompt).input_ids) == it.prompt_tokens
    if name == "random":
        assert all(it.prompt_tokens == length for it in a)
    if name == "agent":  # each turn extends the previous one: a shared, growing prefix
        conv0 = [it for it in a if it.conversation == 0]
        assert all(x.prompt in y.prompt[:len(x.prompt)] for x, y in zip(conv0, conv0[1:]))


def test_harness_on_live_server_metrics_consistent(live, tok, tmp_path) -> None:
    url, pid = live
    items = datasets.build("random", tok, 6, 12, 40)
    before = _gen_tokens(url)
    res = bench(items, [1, 3], url, MODEL, server_pid=pid, ignore_eos=True, progress=False)
    after = _gen_tokens(url)
    total = 0
    for s in res["levels"]:
        assert s["success"] == 6 and s["failed"] == 0
        for key in ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "e2e_p50", "output_throughput",
                    "request_throughput", "wall_s"):
            assert s[key] is not None and s[key] > 0, key
        for r in s["records"]:
            assert r["ttft"] <= r["e2e"] and r["output_tokens"] == 12
        total += s["output_tokens"]
        assert s["peak_rss"] and s["peak_rss"] > 2**28
    assert total == after - before, "output tokens must sum to what the server generated"
    assert "| 3 | 6/6 |" in markdown(res)
    from flatserve.bench.plots import plot_runs

    res["label"] = "flatserve"
    for p in plot_runs([res, {**res, "label": "copy"}], tmp_path):
        assert p.stat().st_size > 1000


def test_cli_bench_serve_and_cliff(live, tmp_path) -> None:
    url, pid = live
    r = subprocess.run([sys.executable, "-m", "flatserve.cli", "bench", "serve", "--base-url", url,
                        "--model", MODEL, "--dataset", "chat", "--num-prompts", "2", "--input-len", "60",
                        "--max-tokens", "4", "--concurrency", "1,2", "--out", str(tmp_path),
                        "--no-progress", "--label", "fs"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    saved = json.loads((tmp_path / "fs-chat.json").read_text())
    assert [s["success"] for s in saved["levels"]] == [2, 2]
    assert (tmp_path / "fs-chat" / "throughput.png").stat().st_size > 1000
    r = subprocess.run([sys.executable, "-m", "flatserve.cli", "bench", "serve", "--base-url", url,
                        "--model", MODEL, "--dataset", "chat", "--num-prompts", "1", "--input-len", "60",
                        "--max-tokens", "4", "--concurrency", "1", "--out", str(tmp_path / "np"),
                        "--no-progress", "--no-plots", "--label", "fs"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    assert (tmp_path / "np" / "fs-chat.json").exists() and not (tmp_path / "np" / "fs-chat").exists()
    r = subprocess.run([sys.executable, "-m", "flatserve.cli", "bench", "cliff", "--base-url", url,
                        "--model", MODEL, "--lengths", "300,50,10", "--max-tokens", "8", "--server-pid",
                        str(pid), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-1500:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["lengths"] == [300, 50, 10] and res["sequential_wall_s"] > 0 and res["concurrent_wall_s"] > 0


def _fake_server(port: int) -> threading.Thread:
    """Streams a 3-token completion, but every third request gets HTTP 500 and every fifth an
    empty completion: neither may count as a success."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app, n = FastAPI(), {"i": 0}

    @app.post("/v1/completions")
    async def comp() -> object:
        n["i"] += 1
        i = n["i"]
        if i % 3 == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def gen():
            pieces = [] if i % 5 == 0 else ["a", "b", "c"]
            for p in pieces:
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": p}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 1,
                                         "completion_tokens": len(pieces)}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    return t


def test_success_counting_is_honest_with_a_failing_endpoint() -> None:
    port = _free_port()
    _fake_server(port)
    url = f"http://127.0.0.1:{port}"
    for _ in range(50):
        try:
            httpx.get(url + "/docs", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    items = [datasets.Item("x", 1, 3) for _ in range(15)]
    res = bench(items, [1], url, "m", progress=False)
    s = res["levels"][0]
    # requests 3,6,9,12,15 fail with 500; 5 and 10 stream nothing: 15 - 5 - 2 = 8 successes
    assert s["success"] == 8 and s["failed"] == 7
    assert s["output_tokens"] == 8 * 3
    assert any("HTTP 500" in e for e in s["errors"])


def test_dropped_connection_is_resent_and_counted() -> None:
    """A raw socket server that closes every other connection before answering (llama-server's
    habit): each request succeeds on its second attempt and the re-send is counted."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    body = ("data: " + json.dumps({"choices": [{"index": 0, "text": "hi"}]}) + "\n\ndata: [DONE]\n\n").encode()

    def serve() -> None:
        for i in itertools.count():
            conn, _ = srv.accept()
            conn.recv(65536)
            if i % 2 == 1:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    res = bench([datasets.Item("x", 1, 3) for _ in range(3)], [1], f"http://127.0.0.1:{port}", "m",
                progress=False)
    s = res["levels"][0]
    assert s["success"] == 3 and s["connection_retries"] == 3


def test_offline_cpu_floor_and_bound_by_hand() -> None:
    """The CPU benchmark's floor and one-token-step bound on a toy cost table, computed by hand:
    2 prompts of 3 and 10 tokens, 3 output tokens each, 1 global + 1 window-4 layer."""
    from benchmarks.offline_cpu import floor_and_bound, step_bytes

    costs = {"layer_params": 10, "lm_head_params": 100, "weight_params": 110,
             "kv_elems_per_token_layer": 2, "global_layers": 1, "window_layers": 1, "window": 4}
    # Step k reads contexts 3+k-1 and 10+k-1 in the global layer, capped at 4 in the window one.
    assert step_bytes(costs, [3, 10], 1, 2, 2) == 110 * 2 + ((3 + 10) + (3 + 4)) * 2 * 2
    assert step_bytes(costs, [3, 10], 3, 2, 2) == 110 * 2 + ((5 + 12) + (4 + 4)) * 2 * 2
    r = {"engine": "flatserve", "prompt_lens": [3, 10], "prompt_tokens": 13, "out_tokens": 6}
    got = floor_and_bound(costs, r, 3, rate=1.0, bw=1.0, elt=2)
    mem = [step_bytes(costs, [3, 10], k, 2, 2) for k in (1, 2, 3)]
    assert got["t_memory"] == sum(mem)
    assert got["t_compute"] == 2 * ((13 + 6) * 10 + 6 * 100)
    # Bound: every prompt token's layers and each request's first LM-head row, then 2 steps.
    assert got["t_bound"] == 2 * (13 * 10 + 2 * 100) + mem[1] + mem[2]
    assert got["floor_tok_per_s"] == 6 / max(got["t_compute"], got["t_memory"])
