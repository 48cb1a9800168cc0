#!/usr/bin/env bash
# Sweep the prefill tile config on the GPU: BLOCK_M,TILE,warps,stages
for cfg in 64,64,8,2 128,64,8,2 128,32,4,2 128,64,4,3 64,32,4,2 128,128,8,2; do
  echo "== $cfg"
  FLATSERVE_PREFILL_CFG=$cfg python3 - <<'PY'
import sys; sys.path.insert(0, ".")
import torch, triton
from benchmarks.attention_kernels import bench_case, CASES
ceil = {"copy_GBps": 4247.0, "matmul_TFLOPs": 684.0}
for c in CASES:
    if "prefill" in c[0] or "chunk" in c[0] or "mixed" in c[0] or "verify" in c[0]:
        r = bench_case(*c, ceil, peer=False)
        print(f"{c[0]:40s} {r['us']:8.1f} us")
PY
done
