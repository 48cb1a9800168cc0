export PYTHONPATH=$PWD
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | grep -v -i warn | tail -1
T0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_cuda_gemv.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
echo "tests $(( $(date +%s) - T0 )) s"
timeout 240 python3 benchmarks/dev/gemv_seq_ab.py --rounds 2 --seqs 4,2:4,1:8,1:2,2 2>&1 | grep -v Warning | tee $OUT/seq_ab.txt
echo "probe $(( $(date +%s) - T0 )) s"
SB="python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy --batch 1 --steps 40 --no-async-scheduling --quantization q4_0"
i=0
for r in 0 4,2 0 4,2 0 4,2; do i=$((i+1))
  [ $(( $(date +%s) - T0 )) -gt 530 ] && break
  FLATSERVE_GEMV_SEQ=$r timeout 100 $SB > $OUT/sb_seq${r/,/_}_$i.txt 2>&1
  echo "seq $r: $(tail -1 $OUT/sb_seq${r/,/_}_$i.txt | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print({k: round(v,3) for k,v in d.items() if k in ("forward","gpu","floor_ms")})' 2>&1 | tail -1)  t=$(( $(date +%s) - T0 ))"
done
