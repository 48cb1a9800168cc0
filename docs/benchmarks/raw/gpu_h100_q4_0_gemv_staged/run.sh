set -u
export PYTHONPATH=$PWD
T0=$(date +%s)
TARGETS="tests/model/test_cuda_gemv.py" SMOKE=0 WORKERS=8 bash scripts/gpu_tests.sh -rfs -p no:randomly 2>&1 | grep -E "passed|failed|FAILED|Error|error" | tail -12
echo "tests took $(( $(date +%s) - T0 )) s"
python3 benchmarks/dev/gemv_async_ab.py 2>&1 | tee $OUT/gemv_async_ab.txt | tail -8
echo "probe done $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
i=0
for v in "0 0" "8 0" "16 0" "16 1" "8 1" "0 0" "16 0" "8 0" "8 1" "16 1" "0 0" "16 0" "8 0"; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 555 ] && break
  set -- $v
  FLATSERVE_GEMV_ASYNC=$1 FLATSERVE_GEMV_ASYNC4=$2 $SB > $OUT/sb_a$1_all$2_$i.txt 2>&1
  echo "async=$1 all4=$2 $(tail -1 $OUT/sb_a$1_all$2_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","engine_step_back_to_back")})' 2>&1 | tail -1)  t=$(( $(date +%s) - T0 ))"
done
