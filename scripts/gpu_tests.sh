#!/usr/bin/env bash
# Every test on a CUDA machine (the README's suite, CUDA tests included), then the GPU
# benchmarks' smoke runs. Run it whenever a change touches code the GPU path uses:
#   bash scripts/gpu_tests.sh            # the whole suite (xdist) + smoke runs
#   bash scripts/gpu_tests.sh -k triton  # extra pytest arguments narrow the suite
#   TARGETS="tests/model tests/ops" SMOKE=0 bash scripts/gpu_tests.sh   # a part (one call each)
# The machine needs torch with CUDA and transformers; the rest of the project's Python packages
# come from PyPI or, on a machine with no network, from wheels in .whl/ (see docs/structures.md,
# "Testing on a GPU"). The default model's package (245 MB) is not carried: its tests skip there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
need="gguf fastapi uvicorn prometheus-client pydantic httpx pytest hypothesis openai psutil xgrammar jsonschema pytest-xdist ninja"
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --find-links .whl $need 2>&1 | grep -v -i warning | tail -3
  # The transformers the CPU suite runs (pyproject's floor): the parity tests compare against it,
  # and older ones lack what the GGUF and GPT-OSS paths read. Its own needs are on the image.
  ls .whl/transformers-*.whl >/dev/null 2>&1 &&
    $PY -m pip install -q --no-index --no-deps .whl/transformers-*.whl 2>&1 | grep -v -i warning | tail -3
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
$PY - <<'PY' || exit 1
import torch, transformers, triton
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name(), f"x{torch.cuda.device_count()}")
PY
workers=${WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
$PY -m pytest -q -n "$workers" -p no:cacheprovider "$@" ${TARGETS:-tests}
rc=$?
[ "${SMOKE:-1}" = 0 ] && exit $rc
echo "== smoke: offline_gpu (qwen3-0.6b shape, 64 prompts, engine defaults)"
$PY benchmarks/offline_gpu.py --shape qwen3-0.6b --prompts 64 --input 128 --output 32 \
    --engines flatserve --out /tmp/offline_gpu_smoke.json --timeout 280 || rc=1
grep -q '"error"' /tmp/offline_gpu_smoke.json && { echo "smoke run failed"; rc=1; }
exit $rc
