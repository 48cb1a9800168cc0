export PYTHONPATH=$PWD
T0=$(date +%s)
python3 scratch_pipe.py 2>&1 | grep -v Warning
echo "probe $(( $(date +%s) - T0 )) s"
for v in 0 2 4; do FLATSERVE_GEMV_PIPE=$v TARGETS="tests/model/test_cuda_gemv.py" SMOKE=0 WORKERS=4 bash scripts/gpu_tests.sh -q -p no:randomly 2>&1 | tail -1; done
echo "tests $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
i=0
for v in 0 2 4 0 2 4 0 2; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 330 ] && break
  FLATSERVE_GEMV_PIPE=$v $SB > $OUT/sb_p${v}_$i.txt 2>&1
  echo "pipe=$v $(tail -1 $OUT/sb_p${v}_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","engine_step_back_to_back","floor_ms")})' 2>&1 | tail -1)  t=$(( $(date +%s) - T0 ))"
done
