#!/usr/bin/env bash
# Issue #30: flatserve serving the default GGUF in its stored Q4_K_M (weights read in place) vs
# llama-server on the same file, 1 stream and 16 streams, the engines alternated ROUNDS times
# (this machine is shared and noisy: ratios come from the same round). Peak RSS from bench
# serve's sampler (the server process and its children).
#   LLAMA_SERVER=/path/to/llama-server bash benchmarks/quant_vs_llamacpp.sh
#   FLATSERVE_ARGS="--dequantize" ...   # the dense path, for the same comparison
# benchmarks/vs_llamacpp_cpu.py makes the same comparison with the CPU's ISA level in its report;
# the current figures (docs/performance-cpu.md) come from it. Runtime (estimate, not timed): about
# 5 minutes a round on 2 cores (4 prompts at 1 stream, 32 at 16, 64 tokens out, per engine).
set -euo pipefail
PY=${PY:-.venv/bin/python}
GGUF=$($PY -c "from flatserve.model.loader import default_model_path; print(default_model_path())")
OUT=${OUT:-bench_out/quant_vs_llamacpp}; mkdir -p $OUT
ROUNDS=${ROUNDS:-2}; N1=${N1:-4}; N16=${N16:-32}; MAXTOK=${MAXTOK:-64}; INPUT=${INPUT:-256}
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary (benchmarks/vs_llamacpp.sh builds one)}"
export LD_LIBRARY_PATH="$(dirname "$LLAMA_SERVER")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wait_up() { until curl -sf http://127.0.0.1:$1/health >/dev/null; do kill -0 $2 || { echo "server on $1 died"; exit 1; }; sleep 1; done; }
bench() {  # port pid label concurrency prompts
  $PY -m flatserve.cli bench serve --base-url http://127.0.0.1:$1 --model "$(basename "$GGUF")" \
    --tokenizer "$GGUF" --dataset random --num-prompts $5 --input-len $INPUT --max-tokens $MAXTOK \
    --concurrency $4 --server-pid $2 --out $OUT --label "$3-c$4" --no-progress >/dev/null
}
for r in $(seq $ROUNDS); do
  $PY -m flatserve.cli serve "$GGUF" --port 8291 --max-model-len 2048 --max-num-seqs 16 ${FLATSERVE_ARGS:-} >$OUT/flatserve.log 2>&1 &
  pid=$!; wait_up 8291 $pid
  bench 8291 $pid flatserve-r$r 1 $N1; bench 8291 $pid flatserve-r$r 16 $N16
  kill $pid; wait $pid || true
  # 16 slots of 2,048 tokens each, as flatserve's max_model_len above.
  "$LLAMA_SERVER" -m "$GGUF" -np 16 -c 32768 -t $(nproc) -cb --host 127.0.0.1 --port 8292 >$OUT/llama.log 2>&1 &
  pid=$!; wait_up 8292 $pid
  bench 8292 $pid llama-r$r 1 $N1; bench 8292 $pid llama-r$r 16 $N16
  kill $pid; wait $pid || true
done
$PY - "$OUT" "$ROUNDS" <<'PY'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
get = lambda lab: json.loads((out / f"{lab}-random.json").read_text())["levels"][0]
print("| round | streams | flatserve out tok/s | llama-server out tok/s | ratio | flatserve peak RSS GiB | llama-server peak RSS GiB |")
print("|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    for c in (1, 16):
        f, l = get(f"flatserve-r{r}-c{c}"), get(f"llama-r{r}-c{c}")
        print(f"| {r} | {c} | {f['output_throughput']:.1f} | {l['output_throughput']:.1f} | "
              f"{f['output_throughput'] / l['output_throughput']:.2f}x | {f['peak_rss'] / 2**30:.2f} | "
              f"{l['peak_rss'] / 2**30:.2f} |")
PY
