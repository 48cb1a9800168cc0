"""Host cost of one engine step at N decodes, the model forward stubbed out (device-independent).

    .venv/bin/python benchmarks/dev/host_step.py 256 [profile]
"""
import cProfile, pstats, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, ".")
import torch
from tests.conftest import build_checkpoint
from flatserve import LLM, SamplingParams
root = Path(tempfile.mkdtemp())
p, _ = build_checkpoint("qwen3", root)
n = int(sys.argv[1])
llm = LLM(model=str(p), dtype="float32", num_gpu_blocks_override=n * 14, max_num_seqs=n, max_num_batched_tokens=max(8192, n * 64))
eng = llm.engine
V = 512
def fake(batch):
    return torch.randn(batch.logits_index.shape[0], V)
eng.runner.forward_logits = fake
sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
for i in range(n):
    eng.add_request([3 + (i * 7 + j) % 500 for j in range(64)], sp)
eng.step(False)
pr = cProfile.Profile()
t = time.perf_counter(); steps = 0
if len(sys.argv) > 2: pr.enable()
while eng.has_unfinished():
    eng.step(False); steps += 1
pr.disable()
dt = time.perf_counter() - t
print(f"{steps} steps, {dt / steps * 1e3:.2f} ms/step host at batch {n}")
if len(sys.argv) > 2: pstats.Stats(pr).sort_stats("tottime").print_stats(22)
