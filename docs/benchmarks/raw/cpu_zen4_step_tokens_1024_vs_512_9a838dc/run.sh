cd /work/main
for i in 1 2; do for t in 1024 512; do
  .venv/bin/python benchmarks/vs_llamacpp_cpu.py --rounds 1 --levels 16 --flatserve-args="--max-num-batched-tokens $t" --out /tmp/ab_${t}_$i > /tmp/ab_${t}_$i.log 2>&1
  echo "$t $i: $(grep -E 'round 1, concurrency 16' /tmp/ab_${t}_$i.log | tail -1) $(grep -E '^\| (flatserve|llama)' /tmp/ab_${t}_$i.log | tail -2 | tr '\n' ' ')"
done; done
