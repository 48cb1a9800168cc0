#!/usr/bin/env bash
# Sweep the kernel's tile configs on the GPU (BLOCK_M,TILE,warps,stages), one process per config.
#   bash benchmarks/sweep_tiles.sh prefill "64,32,4,2 128,64,8,2"
#   bash benchmarks/sweep_tiles.sh decode "16,64,4,2 16,128,4,2"
KIND=${1:-prefill}; CFGS=${2:-"64,64,8,2 128,64,8,2 128,32,4,2 128,64,4,3 64,32,4,2 128,128,8,2"}
VAR=FLATSERVE_PREFILL_CFG; [ "$KIND" = decode ] && VAR=FLATSERVE_DECODE_CFG
for cfg in $CFGS; do
  echo "== $KIND $cfg"
  env $VAR=$cfg KIND=$KIND python3 - <<'PY'
import os, sys; sys.path.insert(0, ".")
from benchmarks.attention_kernels import bench_case, CASES
ceil = {"copy_GBps": 4247.0, "matmul_TFLOPs": 684.0}
for c in CASES:
    decode_only = "decode" in c[0] and "mixed" not in c[0] and "chunk" not in c[0]
    if decode_only == (os.environ["KIND"] == "decode"):
        r = bench_case(*c, ceil, peer=False)
        print(f"{c[0]:40s} {r['us']:8.1f} us", flush=True)
PY
done
