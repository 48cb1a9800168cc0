export PYTHONPATH=$PWD
T0=$(date +%s)
TARGETS="tests/model/test_cuda_gemv.py tests/test_cuda_dense.py tests/test_cuda_e2e.py tests/model/test_quant_triton.py tests/ops/test_pdl.py" SMOKE=0 WORKERS=12 PER_TEST=150 timeout 250 bash scripts/gpu_tests.sh -p no:randomly 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
echo "tests $(( $(date +%s) - T0 )) s"
timeout 150 python3 benchmarks/dev/gemv_kernels.py --rounds 2 2>&1 | grep -v Warning | tee $OUT/gemv_kernels.txt
echo "probe $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling"
i=0
for q in q4_0 bf16 q4_0 bf16 q4_0; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 520 ] && break
  a=""; [ $q = q4_0 ] && a="--quantization q4_0"
  timeout 100 $SB $a > $OUT/sb_${q}_$i.txt 2>&1
  echo "$q: $(tail -1 $OUT/sb_${q}_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","floor_ms")})' 2>&1 | tail -1)  t=$(( $(date +%s) - T0 ))"
done
