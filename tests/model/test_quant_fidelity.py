"""Fidelity of the quantized path (issue #30): teacher-forced over >= 2,000 tokens, the kernel
path (8-bit activations, the weights' blocks read in place) against the same weights dequantized
to fp32 through the torch reference: top-1 agreement >= 99% and mean KL <= 0.01 nats/token.

For the default GGUF (its stored Q4_K_M mix) on real text, and for a random-weight model whose
linears are quantized to each block format. The whole forward takes the int8 kernel
(every row as a generated token's), since that is the path whose activations are quantized."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flatserve import LLM
from flatserve.model import quant
from flatserve.model.qformats import FORMATS
from tests.conftest import random_llama, teacher_forced_hidden

TOKENS = 2048
pytestmark = pytest.mark.skipif(quant.kernel() is None, reason="the C++ quant kernel did not build here")


@contextlib.contextmanager
def _path(model: torch.nn.Module, kernel: bool) -> Iterator[None]:
    """kernel: every call on the 8-bit decode kernel; else the fp32 torch reference."""
    lins = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    old = quant._generated_rows
    quant._generated_rows = lambda rows: True  # every row on the int8 kernel (teacher forcing
    for m in lins:                             # feeds the text as one prompt)
        m.use_kernel = kernel
    try:
        yield
    finally:
        quant._generated_rows = old
        for m in lins:
            m.use_kernel = True


def _logits_pair(llm: LLM, ids: list[int], chunk: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    model = llm.engine.runner.model
    hidden = {}
    for kernel in (True, False):
        with _path(model, kernel):
            hidden[kernel] = teacher_forced_hidden(llm, ids)  # [T, H]
    for i in range(0, len(ids), chunk):  # the logits a chunk at a time (a 262k vocabulary)
        with torch.inference_mode():
            with _path(model, True):
                q = model.compute_logits(hidden[True][i:i + chunk])
            with _path(model, False):
                r = model.compute_logits(hidden[False][i:i + chunk])
        yield q.float(), r.float()


def _fidelity(llm: LLM, ids: list[int]) -> tuple[float, float]:
    agree, kl, n = 0, 0.0, 0
    for q, r in _logits_pair(llm, ids):
        lq, lr = F.log_softmax(q, -1), F.log_softmax(r, -1)
        kl += (lr.exp() * (lr - lq)).sum().item()
        agree += (q.argmax(-1) == r.argmax(-1)).sum().item()
        n += q.shape[0]
    return agree / n, kl / n


def _llm(model: str, **kw) -> LLM:
    return LLM(model=model, device="cpu", dtype="float32", attention_backend="torch",
               max_model_len=TOKENS + 64, num_gpu_blocks_override=TOKENS // 16 + 8, max_num_seqs=1,
               enforce_eager=True, **kw)


def test_default_gguf_q4_k_m_fidelity_on_real_text(default_model_path: Path) -> None:
    llm = _llm(str(default_model_path))
    formats = quant.summary(llm.engine.runner.model)
    assert {"q4_k", "q5_0", "q6_k", "q8_0"} <= set(formats)  # the file's stored mix, kept
    assert "dense" not in formats
    root = Path(__file__).parents[2]
    text = "\n\n".join((root / p).read_text() for p in ("README.md", "docs/structures.md",
                                                         "docs/memory.md", "docs/performance-cpu.md"))
    ids = llm.get_tokenizer().encode(text)[:TOKENS]
    assert len(ids) == TOKENS
    agree, kl = _fidelity(llm, ids)
    assert agree >= 0.99 and kl <= 0.01, (agree, kl)


def _ckpt(root: Path) -> Path:
    """A random-weight Llama whose every linear has K % 256 == 0 (the K formats' super-blocks)."""
    return random_llama(root, "llama256", vocab_size=512, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        initializer_range=0.1)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_random_weight_model_fidelity_per_format(name: str, tmp_path: Path) -> None:
    llm = _llm(str(_ckpt(tmp_path)))
    quant.quantize_model(llm.engine.runner.model, name)
    assert set(quant.summary(llm.engine.runner.model)) == {name}
    g = torch.Generator().manual_seed(FORMATS[name].ggml_type)
    ids = torch.randint(4, 512, (TOKENS,), generator=g).tolist()
    agree, kl = _fidelity(llm, ids)
    assert agree >= 0.99 and kl <= 0.01, (agree, kl)
