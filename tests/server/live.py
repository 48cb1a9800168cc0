"""Start and read a live `flatserve serve` for the robustness tests (a helper, not tests)."""
from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flatserve.bench.serve import wait_healthy

# No C++ kernels (nor their first-start build): the robustness tests exercise the server.
# CPU tests pin the CPU: on a GPU machine a server on `auto` would claim 90% of a card other
# workers' tests share (and be refused).
FAST = ["--device", "cpu", "--attention-backend", "torch", "--fused-ops", "none", "--cpu-gemm", "torch",
        "--enforce-eager"]


NO_CPP = """
import flatserve.kernels as _k
_k.CpuKernel.__call__ = lambda self: None  # see no_cpp_builds
"""


@contextlib.contextmanager
def no_cpp_builds() -> Iterator[None]:
    """These tests exercise validation, isolation and the server, not the kernels: no C++ build
    (minutes on a busy 2-core box, and they fail on AVX2-only CPUs anyway) while inside, so the
    engine runs the torch paths it falls back to. Nothing is cached: later tests build as usual."""
    import flatserve.kernels as kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels.CpuKernel, "__call__", lambda self: None)
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], prelude: str | None = None, key: str | None = None
          ) -> tuple[subprocess.Popen, str]:
    """`flatserve serve ARGS`; `prelude` is Python run first in the server process (fault
    injection by monkeypatching, so production code carries no test hooks)."""
    port = free_port()
    argv = ["serve", "--port", str(port), *FAST, *args] + (["--api-key", key] if key else [])
    code = NO_CPP + (prelude or "") + f"\nimport sys\nfrom flatserve.cli import main\nsys.exit(main({argv!r}))\n"
    # A file, not a pipe: a pipe nobody reads fills up (64 KiB) and blocks the server's logging.
    log = tempfile.NamedTemporaryFile("w+", prefix="flatserve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    proc.log_path = log.name  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=900)  # a busy 2-core box starts slowly
    except BaseException:
        proc.kill()
        print(output(proc))
        raise
    return proc, url


def output(proc: subprocess.Popen) -> str:
    with open(proc.log_path) as f:  # type: ignore[attr-defined]
        return f.read()


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def tiny_model(root: Path) -> Path:
    from tests.conftest import build_checkpoint

    return build_checkpoint("qwen3", root)[0]
