"""Start and read a live `flatserve serve` for the robustness tests (a helper, not tests)."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from flatserve.bench.serve import wait_healthy

# No C++ kernels (nor their first-start build): the robustness tests exercise the server.
FAST = ["--attention-backend", "torch", "--fused-ops", "none", "--cpu-gemm", "torch", "--enforce-eager"]


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
    code = (prelude or "") + f"\nimport sys\nfrom flatserve.cli import main\nsys.exit(main({argv!r}))\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        proc.kill()
        print(proc.stdout.read())
        raise
    return proc, url


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def tiny_model(root: Path) -> Path:
    from tests.conftest import build_checkpoint

    return build_checkpoint("qwen3", root)[0]
