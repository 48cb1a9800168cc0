set -u
export PYTHONPATH=$PWD
T0=$(date +%s)
FLATSERVE_PDL_EARLY=1 FLATSERVE_GEMV_L2PF_MB=40 TARGETS="tests/model/test_cuda_gemv.py tests/ops/test_pdl.py tests/test_cuda_e2e.py" SMOKE=0 WORKERS=8 bash scripts/gpu_tests.sh -rfs -p no:randomly 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
echo "tests took $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
i=0
for v in "0 0" "1 0" "0 16" "1 16" "1 40" "0 0" "1 16" "1 0" "0 16" "1 40" "0 0"; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 545 ] && break
  set -- $v
  FLATSERVE_PDL_EARLY=$1 FLATSERVE_GEMV_L2PF_MB=$2 $SB > $OUT/sb_e$1_pf$2_$i.txt 2>&1
  echo "early=$1 pf=$2 $(tail -1 $OUT/sb_e$1_pf$2_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","engine_step_back_to_back")})' 2>&1 | tail -1)  t=$(( $(date +%s) - T0 ))"
done
