cd /work/main
for r in 1 2; do
for t in 512 2048; do
FLATSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/vs_llamacpp_cpu.py --engines flatserve --rounds 1 --levels 16 "--flatserve-args=--max-num-batched-tokens $t" --out /tmp/avx2q_T${t}_r$r > /tmp/avx2q_T${t}_r$r.log 2>&1
grep -A4 "| engine" /tmp/avx2q_T${t}_r$r.log | grep flatserve | sed "s/^/T=$t r$r /"
done; done
