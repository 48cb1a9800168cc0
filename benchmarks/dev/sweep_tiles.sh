#!/usr/bin/env bash
# Sweep the unified attention kernel's tile configs on the GPU (BLOCK_M,TILE,warps,stages), one
# process per config: benchmarks/attention_kernels.py on the decode-only cases, or on the others
# (verify, prefill, chunk, mixed), without the SDPA peer; one JSON per config under bench_out/.
#   PYTHONPATH=. bash benchmarks/dev/sweep_tiles.sh prefill "64,32,4,2 128,64,8,2"
#   PYTHONPATH=. bash benchmarks/dev/sweep_tiles.sh decode "16,64,4,2 16,128,4,2"
# Runtime: about a minute per config on an H100/H200 (an estimate: the ceilings, then each case
# timed twice, 120 calls each).
KIND=${1:-prefill}; CFGS=${2:-"64,64,8,2 128,64,8,2 128,32,4,2 128,64,4,3 64,32,4,2 128,128,8,2"}
VAR=FLATSERVE_PREFILL_CFG; [ "$KIND" = decode ] && VAR=FLATSERVE_DECODE_CFG
# Case-name substrings (attention_kernels.py --cases): "decode " (with the space) matches the
# decode-only cases and not "63 decodes" / "32 decodes".
CASES="verify,prefill,chunk,mixed"; [ "$KIND" = decode ] && CASES="decode "
for cfg in $CFGS; do
  echo "== $KIND $cfg"
  env $VAR=$cfg python3 benchmarks/attention_kernels.py --no-sdpa --cases "$CASES" \
    --out "bench_out/sweep_tiles_${KIND}_${cfg//,/-}.json"
done
