#!/usr/bin/env bash
# Agent split (multi-turn, growing shared prefixes): TTFT with and without prefix caching.
#   bash benchmarks/prefix_cache_agent.sh [NUM_PROMPTS] [INPUT_LEN]
# Two server starts (caching on, then off), one `flatserve bench serve` agent run each; reports
# under bench_out/prefix/. Runtime (estimate, not timed): a few minutes on a 2-core CPU at 8 x 2048.
set -euo pipefail
N=${1:-8}; L=${2:-2048}; PORT=8178; PY=.venv/bin/python
for mode in on off; do
  flag=""; [ "$mode" = off ] && flag="--no-enable-prefix-caching"
  $PY -m flatserve.cli serve --port $PORT --kv-cache-memory 1GiB --max-model-len 4096 $flag >/dev/null 2>&1 &
  pid=$!
  until curl -sf http://127.0.0.1:$PORT/health >/dev/null; do sleep 1; done
  model=$(curl -s http://127.0.0.1:$PORT/v1/models | $PY -c "import json,sys;print(json.load(sys.stdin)['data'][0]['id'])")
  $PY -m flatserve.cli bench serve --base-url http://127.0.0.1:$PORT --model "$model" --dataset agent \
     --num-prompts $N --input-len $L --max-tokens 16 --concurrency 1 --server-pid $pid \
     --out bench_out/prefix --label "caching-$mode" --no-progress
  kill $pid; wait $pid || true
done
