export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m flatserve.bench.random_ckpt qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 90 python3 benchmarks/step_breakdown.py --ckpt /tmp/ckpt/qwen3-0.6b --batch 64,256 --out $OUT/step_async_pinned.json 2>&1 | grep '^{'
timeout 100 python3 benchmarks/offline_gpu.py --ckpt /tmp/ckpt/qwen3-0.6b --prompts 500 --input 512 --output 128 --max-num-seqs 512 --max-num-batched-tokens 32768 --engines flatserve --out $OUT/q06_500_pin_r4.json 2>&1 | tail -1 | cut -c1-300
