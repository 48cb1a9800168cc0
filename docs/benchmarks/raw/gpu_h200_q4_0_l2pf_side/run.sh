set -u
export PYTHONPATH=$PWD
T0=$(date +%s)
for m in during after; do
FLATSERVE_L2PF=$m TARGETS="tests/model/test_cuda_gemv.py tests/test_cuda_dense.py" SMOKE=0 WORKERS=8 bash scripts/gpu_tests.sh -rfs -p no:randomly -k "gemv or quantized_gguf" 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -5
done
echo "tests took $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
i=0
for v in "0 16" "during 16" "after 16" "during 32" "after 8" "0 16" "during 16" "after 16" "during 32" "0 16" "after 32"; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 540 ] && break
  set -- $v
  FLATSERVE_L2PF=$1 FLATSERVE_L2PF_MB=$2 $SB > $OUT/sb_$1_$2_$i.txt 2>&1
  echo "l2pf=$1 mb=$2 $(tail -1 $OUT/sb_$1_$2_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","engine_step_back_to_back","floor_ms")})' 2>&1 | tail -1)  t=$(( $(date +%s) - T0 ))"
done
