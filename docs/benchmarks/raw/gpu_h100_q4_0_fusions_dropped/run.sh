set -u
export PYTHONPATH=$PWD
T0=$(date +%s)
TARGETS="tests/model/test_cuda_gemv.py tests/attention/test_kernels.py tests/ops tests/test_fused_ops.py tests/test_cuda_e2e.py" SMOKE=0 WORKERS=14 bash scripts/gpu_tests.sh -rfs 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -15
echo "tests took $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
for v in "0 0" "1 1" "0 0" "1 1" "1 0" "0 1"; do set -- $v
  [ $(( $(date +%s) - T0 )) -gt 500 ] && break
  FLATSERVE_FUSED_MERGE=$1 FLATSERVE_GEMV_ACT=$2 $SB > $OUT/sb_m$1_a$2.txt 2>&1
  echo "merge=$1 act=$2 $(tail -1 $OUT/sb_m$1_a$2.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","engine_step_back_to_back")})')  t=$(( $(date +%s) - T0 ))"
done
