"""A CPU decode step's decoder layers in one C++ call (`ops/csrc/decoder_stack_cpu.cpp`).

Why: the kernels of a decode step are short (a 16-row linear of Gemma 3 270M reads 1-5 MB), and
the Python between ~200 of them (module calls, views, pybind argument conversion) was ~17% of
the main thread at 16 decodes (perf, benchmarks/dev/cpu_profile_step.py). The stack calls the same
kernels in the same order from C++, so its output is bit-identical to the Python layers running
those kernels (tests/test_cpu_stack.py); the layers stay the reference and run every step the
stack does not take (prompt chunks, where host time is noise against 300 ms of GEMMs).

It takes a model whose every layer runs on the C++ path: AMX or AVX2 linears (packed, the
gate_up GEMM gated) or quantized ones (GGUF blocks, QuantLinear.pack; act_and_mul after the
gate_up GEMM), the fused norm and rope ops, the CPU attention backend's decode kernel (head size a
multiple of 16), one eps and norm offset. `build` returns None for anything else, and the
runner then keeps the Python layers (`enforce_eager=True` does so on purpose).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatserve.attention import cpu_backend
from flatserve.attention.metadata import current_metadata
from flatserve.kernel_build import CpuKernel
from flatserve.model.amx import GATED_ACTS

_SRC = Path(__file__).parents[1] / "ops" / "csrc" / "decoder_stack_cpu.cpp"
# No arithmetic of its own (it calls the other kernels' ops through torch's dispatcher): one
# portable build serves every ISA level.
_ext = CpuKernel("flatserve_decoder_stack_cpu", _SRC, "decode steps run the decoder layers from Python",
                 level_free=True)
_EMPTY = torch.empty(0, dtype=torch.bfloat16)

# The norm roles of the C++ layer, in its order; each decoder layer class names its modules
# for them in `stack_norms` (None: the model has no such norm).
ROLES = ("in", "attn_out", "mlp_in", "mlp_out")


class CpuDecoderStack:
    """Callable as `DecoderLayers.fast`: (h, residual, positions) -> (h, residual), or None for a
    step it does not take (a sequence with more new tokens than the decode kernel's rows)."""

    def __init__(self, stack: object, ropes: list[nn.Module], max_rows: int) -> None:
        self.stack, self.ropes, self.max_rows = stack, ropes, max_rows

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = current_metadata()
        if meta.max_q_len > self.max_rows or not cpu_backend.decode_only(meta):
            return None  # prompt rows: the Python layers send them to the prompt kernel
        tables = [r.table(meta.max_seq_len + 1) for r in self.ropes]  # [2, P, D] each, grown lazily
        h, residual = self.stack.forward(
            h, _EMPTY if residual is None else residual, positions.contiguous(), tables,
            meta.slot_mapping, meta.block_table.contiguous(), meta.seq_lens.contiguous(),
            meta.cu_seqlens_q.contiguous())
        return h, residual


def build(layers: nn.ModuleList, backend: object) -> CpuDecoderStack | None:
    """The stack for these decoder layers (their KV caches bound), or None where any layer
    would leave the C++ path (the reason is not logged: the Python layers are the normal path
    on every other device too)."""
    from flatserve.ops import cpu_ops

    if not isinstance(backend, cpu_backend.CpuAttentionBackend) or len(layers) == 0:
        return None
    first = layers[0]
    norms = getattr(first, "stack_norms", None)
    if norms is None:
        return None
    ref = getattr(first, norms[0])  # the stack takes one eps and norm offset for every norm
    if not all(_fits(layer, norms, ref) for layer in layers):
        return None
    attn = first.self_attn
    gemm = _gemm_op(first.self_attn.qkv_proj)
    if not (cpu_ops.available() and cpu_backend.available() and gemm):
        return None  # each loads its kernel module, registering the ops the stack calls
    ext = _ext()
    if ext is None:
        return None
    modules = [cpu_ops.module.name, gemm, cpu_backend.kernel.name]  # the op namespaces
    mlp = first.mlp
    gated = mlp.gated  # AMX / AVX2: act in the gate_up GEMM; quantized: act_and_mul after it
    act = mlp.gate_up_proj.act if gated else GATED_ACTS[mlp.act_name]
    stack = ext.Stack(modules, attn.hq, attn.hkv, attn.d, ref.eps, bool(ref.offset), act, gated)
    ropes: list[nn.Module] = []
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        rope = next((i for i, r in enumerate(ropes) if r.store is a.rotary.store), None)
        if rope is None:
            rope = len(ropes)
            ropes.append(a.rotary)
        weight = [getattr(layer, n).weight if n else _EMPTY for n in norms]
        weight += [a.q_norm.weight, a.k_norm.weight] if a.qk_norm else [_EMPTY, _EMPTY]
        linears = [_packed(a.qkv_proj), _bias(a.qkv_proj), _packed(a.o_proj), _bias(a.o_proj),
                   _packed(mlp.gate_up_proj), _packed(mlp.down_proj)]
        p = a.params
        stack.add(weight, linears, list(a.kv_cache), p.scale, p.sliding_window or 0,
                  p.softcap or 0.0, rope)
    return CpuDecoderStack(stack, ropes, cpu_backend.MAX_KERNEL_ROWS)


def _gemm_op(linear: nn.Module) -> str | None:
    """The stack's GEMM op, "module::op", for this model's linears (AMX, AVX2 or quantized: one
    signature)."""
    from flatserve.model import amx, avx2, quant

    if isinstance(linear, amx.AMXLinear) and amx.available(torch.bfloat16):
        return f"{amx._ext.name}::amx_linear"
    if isinstance(linear, avx2.AVX2Linear) and avx2.available(torch.bfloat16):
        return f"{avx2._ext.name}::avx2_linear"
    if isinstance(linear, quant.QuantLinear) and quant.kernel() is not None:
        return f"{quant._ext.name}::quant_linear"
    return None


def _packed(linear: nn.Module) -> torch.Tensor:
    from flatserve.model.quant import QuantLinear

    return linear.pack() if isinstance(linear, QuantLinear) else linear.packed


def _bias(linear: nn.Module) -> torch.Tensor:
    return _EMPTY if linear.bias is None else linear.bias


def _fits(layer: nn.Module, norms: tuple[str | None, ...], ref: nn.Module) -> bool:
    """Every kernel of this layer is the one the stack calls, with the same arguments."""
    from flatserve.model.amx import AMXLinear
    from flatserve.model.avx2 import AVX2Linear
    from flatserve.model.layers import RMSNorm
    from flatserve.model.quant import QuantLinear
    from flatserve.ops import cpu_ops

    a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if a is None or mlp is None or a.kv_cache is None or a.fused is None or a.d % 16:
        return False
    if getattr(a, "sinks", None) is not None or not hasattr(mlp, "gate_up_proj"):
        return False  # sinks and MoE blocks: not kernels the stack calls
    if getattr(layer, "residual_multiplier", 1.0) != 1.0:
        return False  # the stack has no Granite multipliers
    if a.rotary is None or a.rotary.longrope or a.rotary.dim != a.d:
        return False  # the stack rotates every layer's whole head from positions
    if getattr(layer, "stack_norms", None) != norms:
        return False
    rms = [getattr(layer, n) for n in norms if n] + ([a.q_norm, a.k_norm] if a.qk_norm else [])
    if not all(isinstance(m, RMSNorm) and m.fused is not None and m.eps == ref.eps
               and m.offset == ref.offset for m in rms):
        return False
    lin = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if a.kv_cache[0].dtype != torch.bfloat16:
        return False
    if all(type(m) is QuantLinear for m in lin):  # generated rows only: the int16 kernel's path
        return (all(m.use_kernel and not m.perm.numel() for m in lin) and not mlp.gated
                and mlp.fused is cpu_ops.act_and_mul and mlp.act_name in GATED_ACTS)
    kind = type(a.qkv_proj) if isinstance(a.qkv_proj, (AMXLinear, AVX2Linear)) else None
    return (kind is not None and all(type(m) is kind and not m.plain for m in lin) and mlp.gated
            and not mlp.down_proj.act)
