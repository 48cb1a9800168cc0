"""Issue #32's families beyond token parity (tests/model/test_parity.py runs them against
transformers): each family's GGUF, written from the same random weights as llama.cpp's converter
names them, gives the HF directory's tokens; chat templates as transformers renders them; the
flags each config turns into."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import LLM, SamplingParams
from flatserve.model.config import ModelConfig
from tests.conftest import DENSE_FAMILIES, build_checkpoint, hf_config

GGUF_FAMILIES = ("llama", *DENSE_FAMILIES)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", attention_backend="torch",
               num_gpu_blocks_override=200, max_model_len=512, **kw)


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_gives_the_hf_directory_tokens(family, tmp_path, monkeypatch) -> None:
    from tests.model.gguf_write import write_gguf

    monkeypatch.setenv("FLATSERVE_CACHE", str(tmp_path / "cache"))
    path, hf = build_checkpoint(family, tmp_path)
    from transformers import AutoTokenizer

    gguf_path = write_gguf(hf, AutoTokenizer.from_pretrained(str(path)), tmp_path / f"{family}.gguf")
    rng = random.Random()
    # Lengths past the 64-token windows and Phi-3's 128-token LongRoPE switch, chunked at 64.
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (1, 40, 150, rng.randint(2, 250))]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for src in (path, gguf_path):
        llm = _llm(src, max_num_batched_tokens=64)
        assert llm.engine.state.model.architecture == hf.config.architectures[0] or family == "mistral" \
            or family == "mistral-nowindow"  # llama.cpp writes Mistral as `llama`
        outs.append([o.outputs[0].token_ids
                     for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]


def _tokenizer_with_template(path, template: str, specials: list[str]):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.add_tokens(["system", "user", "assistant", "model"])  # the role names templates write
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return tok


_TEMPLATES = {  # the turn markers each family's template writes, as special tokens
    "mistral": ("MISTRAL", ["[INST]", "[/INST]"]),
    "qwen2": ("CHATML", ["<|im_start|>", "<|im_end|>"]),
    "phi3": ("PHI3", ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]),
    "smollm3": ("CHATML", ["<|im_start|>", "<|im_end|>"]),
    "granite": ("GRANITE", ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"]),
    "gemma2": ("GEMMA", ["<start_of_turn>", "<end_of_turn>"]),
}


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", sorted(_TEMPLATES))
def test_chat_template_matches_transformers(family, source, tmp_path, monkeypatch) -> None:
    """The engine renders a conversation to the ids transformers' apply_chat_template gives, from
    the template the checkpoint ships (HF tokenizer_config or the GGUF's tokenizer.chat_template)."""
    from flatserve.engine import chat
    from tests.model.gguf_write import write_gguf

    monkeypatch.setenv("FLATSERVE_CACHE", str(tmp_path / "cache"))
    path, hf = build_checkpoint(family, tmp_path)
    name, specials = _TEMPLATES[family]
    tok = _tokenizer_with_template(path, getattr(chat, name), specials)
    src = path if source == "hf" else write_gguf(hf, tok, tmp_path / f"{family}.gguf")
    llm = _llm(src)
    msgs = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"},
            {"role": "assistant", "content": "w10"}, {"role": "user", "content": "w11"}]
    if family == "mistral":
        msgs = msgs[1:]
    assert llm._template == tok.chat_template
    ref_text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert llm.get_tokenizer().apply_chat_template(msgs, chat_template=llm._template, tokenize=False,
                                                   add_generation_prompt=True) == ref_text
    if source == "hf":  # the GGUF's byte-level BPE (no merges) cannot split text into the test's
        # made-up words, so ids are compared where the tokenizer is the checkpoint's own
        ours = chat.render(llm.get_tokenizer(), llm._template, msgs)
        ref = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ours == list(ref)
        assert 3 not in ours, "a word or marker fell to <unk>"
    end = {"GEMMA": "<end_of_turn>", "CHATML": "<|im_end|>", "PHI3": "<|end|>", "MISTRAL": None,
           "GRANITE": "<|end_of_text|>"}[name]
    if end is not None:  # the engine stops a turn on the template's end marker
        assert llm._eot == tok.convert_tokens_to_ids(end)


def test_family_flags_from_configs() -> None:
    """What each family's config turns into: windows, NoPE layers, biases, partial rotary,
    LongRoPE, Granite's multipliers, Gemma 2's caps."""
    c = {f: ModelConfig.from_hf(hf_config(f)) for f in DENSE_FAMILIES}
    assert c["mistral"].sliding_windows == (64,) * 4 and c["mistral-nowindow"].sliding_windows == (None,) * 4
    assert c["qwen2"].qkv_bias and not c["qwen2"].attention_bias
    assert c["phi3"].rotary_dim == 36 and c["phi3"].head_dim == 48
    r = c["phi3-longrope"].ropes[0]
    assert r.rope_type == "longrope" and len(r.long_factor) == 18 and r.original_max_position == 128
    assert abs(r.attention_factor - (1 + torch.log(torch.tensor(2048 / 128)) / torch.log(torch.tensor(128.))).sqrt()) < 1e-6
    assert c["phi3-longrope"].rope_switch_len == 128 and c["phi3"].rope_switch_len is None
    assert [r is None for r in c["smollm3"].ropes] == [False, False, False, True]
    g = c["granite"]
    assert (g.embedding_multiplier, g.residual_multiplier, g.query_scale, g.logits_scaling) == (12.0, 0.22, 0.05, 4.0)
    g2 = c["gemma2"]
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (2.0, 20.0)
    assert g2.sliding_windows == (64, None, 64, None) and abs(g2.query_scale - 32 ** -0.5) < 1e-12
    # The test checkpoint's scalar is its head size (as 2B/9B); 27B's (hidden / heads) is read too.
    cfg27 = hf_config("gemma2")
    cfg27.query_pre_attn_scalar = 24
    assert abs(ModelConfig.from_hf(cfg27).query_scale - 24 ** -0.5) < 1e-12


def test_fused_rope_falls_back_where_the_op_cannot_take_it(tmp_path, caplog) -> None:
    """Partial rotary on the C++ op and NoPE layers keep the torch rotary, with a notice, never
    an assertion."""
    import logging

    from flatserve import ops

    caplog.set_level(logging.INFO, logger="flatserve")
    from flatserve.model.layers import Attention
    from flatserve.model.llama import LlamaForCausalLM

    class WholeHeadsOnly:  # the C++ op's rule, without needing it built
        from flatserve.ops.cpu_ops import rope_fits

        rope_fits = staticmethod(rope_fits)
        qk_norm_rope = object()

    for family, expect in (("phi3", False), ("smollm3", None), ("mistral", True)):
        model = LlamaForCausalLM(ModelConfig.from_hf(hf_config(family)))
        attn = [m for m in model.modules() if isinstance(m, Attention)]
        got = [ops._rope_op(a, WholeHeadsOnly) is WholeHeadsOnly.qk_norm_rope for a in attn]
        if expect is None:  # SmolLM3: every 4th layer has no rotary, the others fuse
            assert got == [True, True, True, False]
        else:
            assert all(g == expect for g in got)
    assert "rotary dims 36" in caplog.text


_SIDECAR = """
import sys
from pathlib import Path
from flatserve.model.loader import gguf_sidecar
print(gguf_sidecar(Path(sys.argv[1])))
"""


def test_concurrent_first_starts_share_one_gguf_sidecar(tmp_path) -> None:
    """Two first starts of one GGUF at once (servers, test workers) both get the sidecar; the
    later rename used to fail on the first one's folder ('Directory not empty')."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from tests.model.gguf_write import write_gguf

    path, hf = build_checkpoint("llama", tmp_path)
    gguf_path = write_gguf(hf, AutoTokenizer.from_pretrained(str(path)), tmp_path / "llama.gguf")
    env = {**os.environ, "FLATSERVE_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _SIDECAR, str(gguf_path)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    dirs = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(dirs) == 1 and (Path(dirs.pop()) / "config.json").exists()
    assert [p.name for p in (tmp_path / "cache" / "gguf-meta").iterdir()] and \
        not [p for p in (tmp_path / "cache" / "gguf-meta").iterdir() if ".tmp" in p.name]
