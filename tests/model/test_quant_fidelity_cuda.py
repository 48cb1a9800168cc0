"""Fidelity of the CUDA quantized path (issue #30), test_quant_fidelity.py's bar on the GPU's
kernels: a random-weight Llama in bf16 whose linears are quantized to a block format,
teacher-forced over 2,048 tokens, its logits against the same blocks dequantized to fp32 through
the torch reference (an fp32 engine on the same checkpoint, `use_kernel` off): mean KL <= 0.01
nats/token, and top-1 agreement within 1 point of what bf16 itself keeps.

Why the top-1 bar is relative: a random model's next-token distributions are nearly flat (top-1
probability ~2% here), so bf16 activations alone move the argmax: the same engine on the torch
reference in bf16 (dequantized weights, torch's matmul) agrees with the fp32 run on 94.5-95.2% of
the tokens (one H200, 2026-11-29, KL 0.0007-0.0008). The kernels may lose at most 1 point more
than that (the issue's 99% allows 1 point against fp32, met on the CPU's fp32 path).

Each linear takes the text's rows `rows` at a time, so one test covers one of the kernel paths a
serving step takes: 1 row is a decode step of one sequence (q4_0: the CUDA C++ GEMVs with their
fp16 products, q4_ks for the >= 40 x SMs-row weights, q4_ksx or the FMA kernel below; the other
formats, and q4_0 where the C++ GEMV did not build: the Triton GEMV), 64 rows a decode batch
(q4_0 / q8_0: the fused GEMM), 2,048 a prompt (dequantize + cuBLAS). Needs CUDA."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the kernels under test are CUDA and Triton)", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

from flatserve import LLM  # noqa: E402
from flatserve.model import quant  # noqa: E402
from flatserve.model.qformats import FORMATS  # noqa: E402
from tests.conftest import random_llama, teacher_forced_hidden  # noqa: E402

TOKENS = 2048


def _ckpt(root: Path) -> Path:
    """A random-weight Llama, bf16-exact (so the bf16 and fp32 engines quantize the same values),
    sized so that one-row q4_0 calls meet every GEMV: gate|up (11,264 rows) and the tied LM head
    (8,192) take q4_ks on an H100 / H200 (>= 40 x 132 rows), q|k|v, o and down q4_ksx (down over a
    cluster of 2: K = 5,632)."""
    return random_llama(root, "llama1024", bf16_exact=True, vocab_size=8192, hidden_size=1024,
                        intermediate_size=5632, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=128, initializer_range=0.05)


def _llm(path: Path, dtype: str) -> LLM:
    # 2,112 tokens of KV here are 8.7 MB in fp32: a small share of the GPU
    return LLM(model=str(path), dtype=dtype, max_model_len=TOKENS + 64, kv_cache_memory=2**26,
               max_num_seqs=1, enforce_eager=True)


@contextlib.contextmanager
def _rows_at_a_time(rows: int) -> Iterator[None]:
    """Every QuantLinear call split into calls of `rows` rows (the kernel paths of a step of
    that many rows)."""
    forward = quant.QuantLinear.forward

    def split(self: quant.QuantLinear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.cat([forward(self, x2[i:i + rows]) for i in range(0, x2.shape[0], rows)])
        return y.reshape(*x.shape[:-1], y.shape[-1])

    quant.QuantLinear.forward = split
    try:
        yield
    finally:
        quant.QuantLinear.forward = forward


_LAST: dict[str, tuple[LLM, LLM]] = {}  # the last format's engines (its row counts share them)


def _quantized(path: Path, name: str) -> tuple[LLM, LLM]:
    """(the bf16 engine on the kernels, the fp32 engine on the torch reference), the same blocks."""
    if name in _LAST:
        return _LAST[name]
    for llm in (e for pair in _LAST.values() for e in pair):
        llm.shutdown()
    _LAST.clear()
    cand, ref = _llm(path, "bfloat16"), _llm(path, "float32")
    for llm in (cand, ref):
        quant.quantize_model(llm.engine.runner.model, name)
    lins = [[m for m in llm.engine.runner.model.modules() if isinstance(m, quant.QuantLinear)]
            for llm in (cand, ref)]
    for a, b in zip(*lins):
        b.use_kernel = False
        for i in range(len(a.fmts)):  # the reference reads the candidate's own bytes (planar or not)
            getattr(b, f"qweight{i}").copy_(getattr(a, f"qweight{i}"))
        b.planar = set(a.planar)
    _LAST[name] = cand, ref
    return cand, ref


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _ckpt(tmp_path_factory.mktemp("fidelity_cuda"))


# q4_0 at every row count (the kernels written for it); the other formats at 1 row (the Triton
# GEMV) and the whole text (their GEMM)
CASES = [("q4_0", 1), ("q4_0", 64), ("q4_0", TOKENS), ("q8_0", 1), ("q8_0", 64)] + \
    [(n, r) for n in sorted(FORMATS) if n not in ("q4_0", "q8_0") for r in (1, TOKENS)]


def _logits(llm: LLM, ids: list[int], kernel: bool, rows: int = 0, chunk: int = 256) -> torch.Tensor:
    """[T, V] fp32 logits of the teacher-forced text, on the kernels (each linear call `rows`
    rows at a time) or on the torch reference."""
    lins = [m for m in llm.engine.runner.model.modules() if isinstance(m, quant.QuantLinear)]
    for m in lins:
        m.use_kernel = kernel
    try:
        with _rows_at_a_time(rows) if kernel else contextlib.nullcontext():
            h = teacher_forced_hidden(llm, ids)
            with torch.inference_mode():
                return torch.cat([llm.engine.runner.model.compute_logits(h[i:i + chunk]).float()
                                  for i in range(0, len(ids), chunk)])
    finally:
        for m in lins:
            m.use_kernel = True


def _against(q: torch.Tensor, r: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(r || q) in nats) over the rows."""
    lq, lr = F.log_softmax(q, -1), F.log_softmax(r, -1)
    kl = (lr.exp() * (lr - lq)).sum(-1).mean().item()
    return (q.argmax(-1) == r.argmax(-1)).float().mean().item(), kl


@pytest.mark.parametrize("name,rows", CASES)
def test_cuda_kernels_fidelity_per_format(name: str, rows: int, ckpt: Path) -> None:
    cand, ref = _quantized(ckpt, name)
    g = torch.Generator().manual_seed(FORMATS[name].ggml_type)
    ids = torch.randint(4, 8192, (TOKENS,), generator=g).tolist()
    fp32 = _logits(ref, ids, kernel=False)
    agree, kl = _against(_logits(cand, ids, kernel=True, rows=rows), fp32)
    agree_bf16, kl_bf16 = _against(_logits(cand, ids, kernel=False), fp32)
    print(f"{name} rows {rows}: top-1 {agree:.4f} KL {kl:.5f}; bf16 reference {agree_bf16:.4f} {kl_bf16:.5f}")
    assert kl <= 0.01 and agree >= agree_bf16 - 0.01, (agree, kl, agree_bf16, kl_bf16)
