"""Shared fixtures: tiny random-weight HF checkpoints (no hub) and the default GGUF model."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 512


def _tokenizer() -> Any:
    from flatserve.bench.random_ckpt import word_tokenizer

    return word_tokenizer(VOCAB)


def hf_config(family: str) -> Any:
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.1)
    if family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 256})
    if family == "gemma3":
        return Gemma3TextConfig(**common, sliding_window=64, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "sliding_attention",
                                             "full_attention", "sliding_attention"],
                                architectures=["Gemma3ForCausalLM"])
    raise ValueError(family)


def build_checkpoint(family: str, root: Path, seed: int = 0) -> tuple[Path, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    path = root / family
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path, model


@pytest.fixture(scope="session", params=["qwen3", "llama", "gemma3"])
def tiny_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[str, Path, Any]:
    path, model = build_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"))
    return request.param, path, model


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from flatserve.model.loader import default_model_path as dmp

    return dmp()


def _at_level(level: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the C++ CPU kernels at ISA level `level` for one test (FLATSERVE_CPU_ISA is read at
    each call); a level this CPU cannot run skips, saying which flags it lacks."""
    from flatserve import device as dev

    if level not in dev.cpu_isa_levels():
        pytest.skip(f"this CPU cannot run ISA level {level} (it runs {', '.join(dev.cpu_isa_levels())})")
    monkeypatch.setenv("FLATSERVE_CPU_ISA", level)
    return level


@pytest.fixture(params=["amx", "avx512", "avx2", "portable"])
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every ISA level of the kernels built at every level (decode attention, fused ops)."""
    return _at_level(request.param, monkeypatch)


@pytest.fixture(params=["amx"])
def amx_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The amx level, for the kernels that exist only there (prefill, AMX GEMM, greedy head)."""
    return _at_level(request.param, monkeypatch)


def require_kernel(kernel: Any) -> Any:
    """The kernel's module at this test's level; a failed build is a failure, not a skip (the
    CPU runs the level, so the build must work: scripts/setup.sh built it)."""
    mod = kernel()
    assert mod is not None, f"{kernel.name} did not build: {kernel.error}"
    return mod


@pytest.fixture
def amx_kernel(amx_isa: str) -> None:
    """The amx level with the AMX GEMM kernel built and granted tile state by the OS."""
    import torch

    from flatserve.model import amx

    require_kernel(amx._ext)
    assert amx.available(torch.bfloat16), "AMX kernel built but not available (OS tile grant, oneDNN)"
