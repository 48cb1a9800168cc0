export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -x tests/test_fused_ops.py 2>&1 | tail -4
python3 -m flatserve.bench.random_ckpt qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for f in none auto rmsnorm rope act; do echo "== fused $f"; timeout 100 python3 benchmarks/step_breakdown.py --ckpt /tmp/ckpt/qwen3-0.6b --fused-ops $f --batch 64,256 --out $OUT/step_$f.json 2>&1 | grep '^{'; done
for c in 16,64,4,2 16,32,4,2 16,32,4,3 16,32,4,4; do echo "== $c"; bash benchmarks/sweep_tiles.sh decode "$c" 2>&1 | grep " us" | head -3; done
