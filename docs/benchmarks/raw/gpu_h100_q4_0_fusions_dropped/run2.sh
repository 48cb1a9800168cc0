set -u
export PYTHONPATH=$PWD
T0=$(date +%s)
TARGETS="tests/model/test_cuda_gemv.py tests/ops/test_pdl.py tests/test_cuda_e2e.py tests/model/test_quant_triton.py" SMOKE=0 WORKERS=14 bash scripts/gpu_tests.sh -rfs 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -15
echo "tests took $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
i=0
for v in 0 1 0 1 0 1 0 1; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 520 ] && break
  FLATSERVE_GEMV_MMA2=$v $SB > $OUT/sb_mma2_${v}_$i.txt 2>&1
  echo "mma2=$v $(tail -1 $OUT/sb_mma2_${v}_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","engine_step_back_to_back")})')  t=$(( $(date +%s) - T0 ))"
done
