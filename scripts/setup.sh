#!/usr/bin/env bash
# Create .venv with the local CPU torch build and flatserve (editable) plus test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
# The chat page's browser test (tests/server/test_ui.py) drives Debian's chromium through
# Playwright; install it where it is missing and we can (root with apt), else that test skips.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch==2.13.0 resolves to the CPU wheel on this machine kind; a looser spec pulls CUDA (GBs).
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test]'
# The C++ CPU kernels, every ISA level this CPU runs, in parallel processes (flatserve/kernels.py):
# a start then only loads them. A kernel that fails is remembered with its cause (and the
# engine's fallback runs); `python -m flatserve.kernels status` lists them.
python -m flatserve.kernels build
