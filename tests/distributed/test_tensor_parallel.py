"""Tensor parallelism on the CPU over gloo: TP=2 gives TP=1's (and transformers') greedy tokens
over ragged batches, chunked prefill and preemption; KV heads replicate when tp > Hkv; two
"hosts" on loopback; the rendezvous names missing ranks."""
from __future__ import annotations

import random
import socket
import subprocess
import sys
import time

import pytest

from flatserve import LLM, SamplingParams
from tests.model.test_parity import _assert_greedy_equal, _hf_greedy

# Every engine here: fp32 on the CPU, the torch attention path (no C++ build needed), a pool
# small enough that the 8 prompts preempt, and a token budget that chunks every long prompt.
ENGINE = dict(dtype="float32", device="cpu", attention_backend="torch", enforce_eager=True,
              max_model_len=400, num_gpu_blocks_override=30, max_num_batched_tokens=48,
              enable_prefix_caching=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    # 60-99 tokens: 8 prompts then need >= 653 tokens of KV against the pool's 464, so every
    # seed preempts (2-16 preemptions over 300 seeds; 2-99 gave 0 on 1 seed in 48).
    lens = [1, 100] + [rng.randint(60, 99) for _ in range(n - 2)]
    return [[rng.randrange(4, 512) for _ in range(L)] for L in lens]


def _greedy(path, prompts, n: int = 24, **kw) -> tuple[list[list[int]], int]:
    with LLM(model=str(path), **{**ENGINE, **kw}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        assert llm.engine.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions


def test_tp2_greedy_equals_tp1_and_transformers(tiny_checkpoint) -> None:
    family, path, hf = tiny_checkpoint
    prompts = _prompts(random.randrange(1 << 30))
    tp1, _ = _greedy(path, prompts)
    tp2, preempted = _greedy(path, prompts, tensor_parallel_size=2)
    assert preempted > 0, "the pool was meant to overflow"
    for p, a, b in zip(prompts, tp1, tp2):
        assert len(b) == 24
        _assert_greedy_equal(hf, p, b, a)  # TP=2 vs TP=1 (a near-tie may flip: fp32 sums reorder)
        _assert_greedy_equal(hf, p, b, _hf_greedy(hf, p, 24))


def _margin_where_they_part(ref: list[int], ours: list[int], ref_logprobs: list) -> float:
    """0 where equal, else the reference's top-2 logprob gap at the first differing output."""
    if ref == ours:
        return 0.0
    k = next(i for i, (x, y) in enumerate(zip(ref, ours)) if x != y)
    top = sorted((lp.logprob for lp in ref_logprobs[k].values()), reverse=True)
    return top[0] - top[1]


@pytest.mark.parametrize("family,quant", [("llama", "q4_0"), ("qwen2", "q8_0")])
def test_tp2_quantized_equals_tp1_quantized(tmp_path, family: str, quant: str) -> None:
    """--quantization under TP=2: each rank quantizes its shard (a block of 32 never straddles
    one), the row-parallel sum and the vocab gather run around the quantized products, the tied
    embedding reads its vocab rows of the head's table (both families tie; qwen2's q|k|v has a
    bias). Tokens equal TP=1's quantized ones but where TP=1's top two are within 1e-3 (only the
    cross-rank sum order differs), no linear stays dense, and a rank holds about half the bytes."""
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint(family, tmp_path, seed=random.randrange(1 << 16))
    prompts = _prompts(random.randrange(1 << 30), n=4)
    runs = {}
    for tp in (1, 2):
        with LLM(model=str(path), **{**ENGINE, "quantization": quant, "tensor_parallel_size": tp}) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True, logprobs=2), use_tqdm=False)
            assert llm.engine.num_used_blocks == 0
            runs[tp] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                        {f: b for f, _, b in llm.engine.state.weight_formats})
    (one, logprobs, bytes1), (two, _, bytes2) = runs[1], runs[2]
    assert set(bytes1) == set(bytes2) == {quant}, (bytes1, bytes2)
    assert 0.4 * bytes1[quant] < bytes2[quant] < 0.6 * bytes1[quant], (bytes1, bytes2)
    for a, b, lps in zip(one, two, logprobs):
        assert len(b) == 16
        assert _margin_where_they_part(a, b, lps) < 1e-3, (a, b)


_GGUF_MIX = {"q_proj.weight": "q4_0", "k_proj.weight": "q5_0", "v_proj.weight": "q8_0",
             "o_proj.weight": "q4_0", "gate_proj.weight": "q5_0", "up_proj.weight": "q4_0",
             "down_proj.weight": "q8_0", "embed_tokens.weight": "q8_0"}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_gguf_kept_quantized_equals_tp1(tmp_path, family: str) -> None:
    """A GGUF's blocks kept as stored under TP=2 (flatserve/distributed/quant_shards.py): each
    rank cuts its rows (q|k|v with qwen2's biases, gate|up, its vocab rows of the tied table)
    and its byte columns (o, down) from the stored blocks. Tokens equal TP=1's but where TP=1's
    top two are within 1e-3, and TP=1's equal the dequantized file's but within 1e-2 (its rows
    quantize activations to int16); no linear is dense, a rank holds about half the bytes; a
    K-format down whose columns per rank are not whole superblocks is refused with a reason."""
    from transformers import AutoTokenizer

    from tests.conftest import build_checkpoint
    from tests.model.gguf_write import write_gguf

    path, hf = build_checkpoint(family, tmp_path, seed=random.randrange(1 << 16))
    gguf = write_gguf(hf, AutoTokenizer.from_pretrained(str(path)), tmp_path / "mix.gguf", _GGUF_MIX)
    prompts = _prompts(random.randrange(1 << 30), n=4)
    runs = {}
    for tp in (0, 1, 2):  # 0: TP=1 on the dequantized file
        how = {**ENGINE, "tensor_parallel_size": max(tp, 1), "dequantize": tp == 0}
        with LLM(model=str(gguf), **how) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True, logprobs=2), use_tqdm=False)
            assert llm.engine.num_used_blocks == 0
            runs[tp] = ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                        {f: b for f, _, b in llm.engine.state.weight_formats})
    (deq, deq_lps, _), (one, logprobs, bytes1), (two, _, bytes2) = runs[0], runs[1], runs[2]
    assert "dense" not in bytes1 and "dense" not in bytes2 and set(bytes1) == set(bytes2), (bytes1, bytes2)
    assert 0.4 * sum(bytes1.values()) < sum(bytes2.values()) < 0.6 * sum(bytes1.values())
    for d, dl, a, b, lps in zip(deq, deq_lps, one, two, logprobs):
        assert len(b) == 16
        assert _margin_where_they_part(a, b, lps) < 1e-3, (a, b)
        assert _margin_where_they_part(d, a, dl) < 1e-2, (d, a)
    k_down = write_gguf(hf, AutoTokenizer.from_pretrained(str(path)), tmp_path / "kdown.gguf",
                        {**_GGUF_MIX, "down_proj.weight": "q4_k"})  # 256 columns: 128 a rank
    with pytest.raises(Exception, match="not whole q4_k blocks of 256: serve this GGUF with --dequantize"):
        LLM(model=str(k_down), **{**ENGINE, "tensor_parallel_size": 2})


def test_tp4_replicates_kv_heads(tmp_path) -> None:
    """2 KV heads over 4 ranks: each KV head lives on 2 ranks."""
    from tests.conftest import build_checkpoint

    path, hf = build_checkpoint("qwen3", tmp_path)
    prompts = _prompts(7, n=3)
    toks, _ = _greedy(path, prompts, n=8, tensor_parallel_size=4)
    for p, t in zip(prompts, toks):
        _assert_greedy_equal(hf, p, t, _hf_greedy(hf, p, 8))


def test_two_hosts_on_loopback_give_the_same_tokens(tmp_path) -> None:
    """Node 1 is `flatserve serve --node-rank 1` in its own process (its ranks only, no
    server); node 0 is this process's engine; they meet at --master-addr/--master-port."""
    from tests.conftest import build_checkpoint

    path, hf = build_checkpoint("llama", tmp_path)
    port = _free_port()
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--dist-timeout", "120"]
    node1 = subprocess.Popen([sys.executable, "-m", "flatserve.cli", "serve", str(path), "--node-rank", "1",
                              *flags, *_cli(ENGINE)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        prompts = _prompts(3, n=4)
        two, _ = _greedy(path, prompts, n=12, tensor_parallel_size=2, nnodes=2, master_port=port,
                         dist_timeout_s=120)
        assert node1.wait(timeout=60) == 0, node1.stdout.read()  # node 0's shutdown ends node 1
    finally:
        if node1.poll() is None:
            node1.kill()
    for p, t in zip(prompts, two):
        _assert_greedy_equal(hf, p, t, _hf_greedy(hf, p, 12))


def _cli(kw: dict) -> list[str]:
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def test_rendezvous_timeout_names_the_missing_ranks(tmp_path) -> None:
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint("qwen3", tmp_path)
    # Node 0 alone (its one rank in this process); node 1 never starts.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 never joined .*node\(s\) \[1\] of 2"):
        LLM(model=str(path), **ENGINE, tensor_parallel_size=2, nnodes=2,
            master_port=_free_port(), dist_timeout_s=3)
    assert time.monotonic() - t0 < 60


def test_config_refuses_what_tp_does_not_support() -> None:
    from flatserve.config import EngineConfig

    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_method="ngram")
    with pytest.raises(ValueError, match="positive multiple of nnodes"):
        from flatserve.distributed.group import Topology

        Topology.of(EngineConfig.from_kwargs(tensor_parallel_size=3, nnodes=2, master_port=1))
