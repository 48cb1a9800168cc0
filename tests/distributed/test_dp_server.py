"""`flatserve serve --data-parallel-size 2`: the server suite (tests/server/test_server.py, all but
its SIGTERM test, which starts its own server) against two replicas behind one server, and the
router's choice."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from flatserve.bench.serve import wait_healthy
from tests.server.test_server import (  # noqa: F401 - collected here against the DP=2 server
    KEY, _free_port, test_32_concurrent_streams_complete_then_no_blocks_used,
    test_auth_and_open_routes, test_bad_inputs_answered_in_openai_shape_and_server_still_serves,
    test_chat_stream_and_non_stream, test_completions_stream_equals_non_stream_with_usage,
    sigterm_mid_stream, test_disconnect_mid_stream_frees_blocks, test_n_logprobs_echo_stop)


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    # The log goes to a file: a pipe nobody reads fills at 64 KiB and stalls the server.
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flatserve.cli", "serve", "--port", str(port), "--api-key", KEY,
         "--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "32",
         "--max-num-batched-tokens", "256",
         "--served-model-name", "gemma-test", "--data-parallel-size", "2", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    yield {"url": url, "proc": proc}
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, "the DP=2 server did not stop cleanly on SIGINT"


def test_router_picks_fewest_held_then_lowest_kv_usage() -> None:
    from flatserve.server.data_parallel import DataParallelEngine

    r = DataParallelEngine.__new__(DataParallelEngine)
    r.replicas = [None, None, None]  # type: ignore[list-item]
    r.held = [2, 1, 1]
    r.stats = [{"kv_blocks_used": 0, "kv_blocks_total": 10}, {"kv_blocks_used": 9, "kv_blocks_total": 10},
               {"kv_blocks_used": 3, "kv_blocks_total": 10}]
    assert r.pick() == 2
    r.held = [0, 1, 1]
    assert r.pick() == 0


def test_sigterm_mid_stream_ends_streams_and_exits_zero_with_two_replicas(default_model_path) -> None:
    sigterm_mid_stream(["--data-parallel-size", "2"])



def test_router_forwards_shutdown_and_fatal_errors_to_every_replica() -> None:
    """The server drains by num_in_flight, closes through close() and stops on on_fatal: on a
    DP router each reaches every replica (a replica that dies stops the server)."""
    from types import SimpleNamespace

    from flatserve.server.data_parallel import DataParallelEngine

    r = DataParallelEngine.__new__(DataParallelEngine)
    closed: list[int] = []
    r.replicas = [SimpleNamespace(num_in_flight=n, on_fatal=None, close=lambda i=i: closed.append(i))
                  for i, n in enumerate([2, 0, 3])]  # type: ignore[assignment]
    assert r.num_in_flight == 5
    stop = object()
    r.on_fatal = stop  # type: ignore[assignment]
    assert [x.on_fatal for x in r.replicas] == [stop] * 3 and r.on_fatal is stop
    r.close()
    assert closed == [0, 1, 2]
