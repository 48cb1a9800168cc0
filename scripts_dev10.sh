export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m flatserve.bench.random_ckpt qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for i in 1 2 3; do timeout 100 python3 benchmarks/offline_gpu.py --ckpt /tmp/ckpt/qwen3-0.6b --prompts 500 --input 512 --output 128 --max-num-seqs 512 --max-num-batched-tokens 32768 --engines flatserve --out $OUT/q06_500_med_r$i.json 2>&1 | tail -1 | cut -c1-400; done
