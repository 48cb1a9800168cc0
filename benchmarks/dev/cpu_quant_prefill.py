"""Prefill time of the default GGUF (quantized linears' prompt rows): 8 prompts of 1,024 random
tokens, one output token each, prefix caching off; three timed runs after a warm-up.

    .venv/bin/python benchmarks/dev/cpu_quant_prefill.py [label]
    FLATSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/dev/cpu_quant_prefill.py avx2

For A/Bs of the prompt GEMM path (flatserve/model/quant.py, _dense_rows): run it on both
checkouts, alternating.
"""
import random
import sys
import time

sys.path.insert(0, ".")

from flatserve import LLM, SamplingParams  # noqa: E402
from flatserve.model.loader import default_model_path  # noqa: E402

llm = LLM(model=str(default_model_path()), max_model_len=4096, enable_prefix_caching=False)
rng = random.Random(0)
ps = [[rng.randrange(100, 20000) for _ in range(1024)] for _ in range(8)]
sp = SamplingParams(max_tokens=1, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in ps[:2]], sp, use_tqdm=False)
ts = []
for _ in range(3):
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    ts.append(time.perf_counter() - t)
print(sys.argv[1] if len(sys.argv) > 1 else "", "8 x 1,024-token prefill, s:", ["%.2f" % x for x in ts])
