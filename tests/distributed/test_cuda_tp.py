"""Tensor and data parallelism on CUDA (NCCL), 2 GPUs: fp32 greedy tokens with TP=2 (CUDA
graphs capturing the all-reduces) equal TP=1's and the eager TP=2 run's. Skipped without 2 GPUs."""
from __future__ import annotations

import os
import random

import pytest
import torch

from flatserve import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import _margin_where_they_part
from tests.model.test_parity import _assert_greedy_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")


def _run(path, prompts, **kw) -> list[list[int]]:
    with LLM(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory=2**30, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        if kw.get("tensor_parallel_size", 1) > 1:
            assert (llm.engine.runner.graphs is None) == kw.get("enforce_eager", False)
            assert os.environ["NCCL_NVLS_ENABLE"] == "0"
        return [o.outputs[0].token_ids for o in outs]


def test_tp2_cuda_graphs_equal_tp1(tiny_checkpoint) -> None:
    family, path, hf = tiny_checkpoint
    rng = random.Random()
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 300))] for _ in range(16)]
    one = _run(path, prompts)
    two = _run(path, prompts, tensor_parallel_size=2)
    two_eager = _run(path, prompts, tensor_parallel_size=2, enforce_eager=True)
    for p, a, b, c in zip(prompts, one, two, two_eager):
        _assert_greedy_equal(hf, p, b, a)
        _assert_greedy_equal(hf, p, c, a)


def test_q4_0_replicas_on_two_gpus_give_the_same_tokens(tiny_checkpoint, monkeypatch) -> None:
    """Data parallelism's layout (flatserve/server/data_parallel.py: replicas on threads, one a
    device): 4-bit weights in bf16, one sequence a replica so every decode step takes the one-row
    CUDA C++ GEMV, the cuda:1 replica driven from a thread of its own. Both GPUs run the same
    kernels on the same bits, so the tokens are equal; the GEMV ran on each device."""
    import threading

    from flatserve.model import cuda_gemv

    family, path, _ = tiny_checkpoint
    if family != "llama":
        pytest.skip("one family is enough for the per-device kernel load")
    launched: dict[int, int] = {}
    real = cuda_gemv.gemv

    def counting(x, *a, **kw):
        ok = real(x, *a, **kw)
        launched[x.device.index] = launched.get(x.device.index, 0) + int(ok)
        return ok

    rng = random.Random()
    prompt = [rng.randrange(4, 512) for _ in range(rng.randint(1, 200))]
    out: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with LLM(model=str(path), dtype="bfloat16", quantization="q4_0", max_model_len=512,
                 kv_cache_memory=2**28, device=f"cuda:{i}") as llm:
            res = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
            out[i] = res[0].outputs[0].token_ids

    monkeypatch.setattr(cuda_gemv, "gemv", counting)
    run(0)
    t = threading.Thread(target=run, args=(1,))
    t.start()
    t.join()
    assert 1 in out, "the cuda:1 replica failed (see the thread's exception above)"
    assert out[0] == out[1]
    assert launched.get(0, 0) > 0 and launched.get(1, 0) > 0, launched


def test_tp2_q4_0_graphs_equal_tp1_q4_0(tiny_checkpoint) -> None:
    """--quantization q4_0 under TP=2 on CUDA (the Triton and CUDA C++ GEMVs of each rank's
    shard inside the captured graphs, all-reduces around them): TP=1's q4_0 tokens but where
    TP=1's top two are within 1e-3 (the cross-rank sum order differs)."""
    family, path, _ = tiny_checkpoint
    if family not in ("llama", "qwen2"):
        pytest.skip("two tied families are enough: the CPU test covers the layers per family")
    rng = random.Random()
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 300))] for _ in range(8)]
    runs = []
    for tp in (1, 2):
        with LLM(model=str(path), dtype="float32", quantization="q4_0", max_model_len=512,
                 kv_cache_memory=2**30, tensor_parallel_size=tp) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
                max_tokens=24, temperature=0, ignore_eos=True, logprobs=2), use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    for (a, lps), (b, _) in zip(*runs):
        assert _margin_where_they_part(a, b, lps) < 1e-3, (a, b)
