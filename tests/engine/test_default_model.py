"""The real default model (Gemma 3 270M Q4_K_M GGUF): parity, batch invariance, bad input."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "The three laws of thermodynamics are", "Water boils at"]


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(device="cpu", model=str(default_model_path), dtype="float32", kv_cache_memory=256 * 2**20,
               max_model_len=2048, max_num_batched_tokens=256)


def test_greedy_matches_transformers_from_the_same_gguf(llm, default_model_path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path.parent),
                                              gguf_file=default_model_path.name,
                                              dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, o in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert o.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        ours = o.outputs[0].token_ids
        if ours != ref:
            k = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            with torch.no_grad():
                top2 = hf(torch.tensor([ids + ref[:k]])).logits[0, -1].topk(2).values
            assert (top2[0] - top2[1]).item() < 1e-4, f"{prompt!r}: diverged at {k}, not a near-tie"


def test_batch_invariance_alone_vs_16_concurrent(llm) -> None:
    rng = random.Random()
    words = "the of and a to in is you that it he was for on are as with his they".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))) for _ in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    for i in rng.sample(range(16), 4):
        alone = llm.generate([prompts[i]], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together[i].outputs[0].token_ids
    assert llm.engine.num_used_blocks == 0 or llm.config.enable_prefix_caching


def test_prefix_cache_hits_do_not_change_greedy_answers(default_model_path) -> None:
    """Prompts served with the default dtype and kernels, prefix caching on: again (only their
    tails computed, through the same row-invariant prompt kernel) and beside prompts sharing
    their prefix, the tokens and logprobs are bit-equal to each prompt served alone, cold."""
    rng = random.Random()
    words = "the of and a to in is you that it he was for on are as with his they".split()
    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    base = text(20, 60)
    prompts = [base + " " + text(1, 30) for _ in range(6)] + [text(17, 90) for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)

    def answers(outs) -> list[tuple[list[int], list[float]]]:
        return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                        o.outputs[0].token_ids)])
                for o in outs]
    llm = LLM(device="cpu", model=str(default_model_path), kv_cache_memory=256 * 2**20,
              max_model_len=1024)
    alone = []
    for p in prompts:  # each served alone on a cold cache
        assert llm.reset_prefix_cache()
        alone.append(answers(llm.generate([p], params, use_tqdm=False))[0])
    assert llm.reset_prefix_cache()
    first = answers(llm.generate(prompts, params, use_tqdm=False))
    before = llm.engine.runner.num_forward_tokens
    again = answers(llm.generate(prompts, params, use_tqdm=False))
    prompt_tokens = sum(len(llm.get_tokenizer()(p).input_ids) for p in prompts)
    assert llm.engine.runner.num_forward_tokens - before < prompt_tokens  # the cache was hit
    assert first == alone and again == alone


@pytest.mark.parametrize("bad,match", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([10**7], "outside the vocabulary"),
    ("word " * 3000, "max_model_len is 2048"),
])
def test_bad_prompts_raise_clear_errors_and_disturb_nothing(llm, bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([bad], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    ok = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_params(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_bad_model_paths(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(device="cpu", model=str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(device="cpu", model=str(tmp_path), num_gpu_blocks_override=8)
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="cannot read GGUF"):
        LLM(device="cpu", model=str(bad))


def test_stop_strings_seed_and_n(llm) -> None:
    base = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0),
                        use_tqdm=False)[0].outputs[0]
    word = base.text.split()[2]
    cut = llm.generate(["The capital of France is"],
                       SamplingParams(max_tokens=16, temperature=0, stop=[word]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == word
    assert cut.outputs[0].text == base.text[:base.text.index(word)]
    p = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=2)
    a = llm.generate(["Tell me"], p, use_tqdm=False)[0]
    b = llm.generate(["Tell me"], p, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len(a.outputs) == 2
