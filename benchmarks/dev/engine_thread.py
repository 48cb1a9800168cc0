"""LLM.generate on the main thread vs on a second thread after building on the main one (libgomp).

    .venv/bin/python benchmarks/dev/engine_thread.py
"""
import sys, time, threading
sys.path.insert(0, ".")
import torch
from flatserve import LLM, SamplingParams
llm = LLM(kv_cache_memory=2**30, max_model_len=2048)
ps = [("word " * 250) + str(i) for i in range(16)]
sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
llm.generate(ps[:1], SamplingParams(max_tokens=4), use_tqdm=False)
def run(tag, setn=False):
    if setn: torch.set_num_threads(2)
    t = time.perf_counter(); llm.generate(ps, sp, use_tqdm=False); w = time.perf_counter() - t
    print(tag, f"{16*32/w:.1f} tok/s", flush=True)
run("main")
th = threading.Thread(target=run, args=("thread+set", True)); th.start(); th.join()
th = threading.Thread(target=run, args=("thread-again",)); th.start(); th.join()
x = torch.randn(16, 640, dtype=torch.bfloat16); w = torch.randn(262144, 640, dtype=torch.bfloat16)
def mm(tag):
    torch.nn.functional.linear(x, w)
    t = time.perf_counter()
    for _ in range(10): torch.nn.functional.linear(x, w)
    print(tag, "lm head", (time.perf_counter() - t) / 10 * 1e3, "ms", flush=True)
mm("main")
th = threading.Thread(target=mm, args=("thread",)); th.start(); th.join()
