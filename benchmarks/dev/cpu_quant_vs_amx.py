"""Generated rows on the AMX machine: the int16 quantized kernel against dequantize-to-bf16 + AMX
tiles, per distinct linear of the default GGUF, at 1 / 4 / 16 rows, one process.

    .venv/bin/python benchmarks/dev/cpu_quant_vs_amx.py

Needs the amx ISA level for the second column (elsewhere it times the torch float path).
"""
import time

import torch
from flatserve import LLM
from flatserve.model import quant
from flatserve.model.loader import default_model_path
llm = LLM(model=str(default_model_path()), max_model_len=512)
m = llm.engine.runner.model
lins = {}
for n, mod in m.named_modules():
    if isinstance(mod, quant.QuantLinear):
        key = (mod.in_features, mod.out_features, "|".join(f.name for f in mod.fmts))
        lins.setdefault(key, (n, mod))
ext = quant.kernel()
def t(f, n=20):
    f(); s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e3
for key, (n, mod) in lins.items():
    for M in (1, 4, 16):
        x = torch.randn(M, mod.in_features).bfloat16()
        nn_ = 3 if mod.out_features > 100000 else 20
        a = t(lambda: mod._int16(ext, x), nn_); b = t(lambda: mod.reference(x, ext), nn_)
        print(n, key, M, f"int16 {a:.3f} ms  dequant+amx {b:.3f} ms")
