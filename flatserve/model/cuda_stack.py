"""A one-token CUDA decode step of a Llama-shaped q4_0 model with the small kernels folded into
its GEMVs (`ops/csrc/q4_gemv_cuda.cu`): a layer is

    q|k|v = W_qkv rmsnorm(h)            q4_ks_scaled: x = bf16(h * nw) from down, 1 / rms at the end
    rope + KV write, attention          the layer's own kernels (Attention.attend_qkv)
    h1 = h + W_o o                      q4_ksx: the residual add in the GEMV's store, and the hand-off:
                                        bf16(h1 * nw) and the CTAs' sums of h1^2 (norm_out)
    a = act(gate) * up, gate|up = W rmsnorm(h1)   q4_ks_scaled_silu: norm in, activation out
    h2 = h1 + W_down a                  q4_ksx (K split over a cluster): the add and the hand-off

(q4_ksx on sm_90; the FMA kernel below it, and with FLATSERVE_GEMV_KSX=0.)

(layer 0's q|k|v normalizes the embedding itself: q4_ks_norm.) 7 launches (8 with the split-KV
merge) where the Python layers make 10: the two fused add + RMSNorm kernels and act_and_mul are
gone. Why: at one token each small kernel is a few microseconds of latency that no weight bytes
move under (docs/performance-gpu.md), ~190 of them a Llama-3-8B forward. The hand-off does the
norm's elementwise half once per row in o's and down's stores instead of in each of the next
GEMV's CTAs (H200 b1 forward 2.105-2.109 against 2.116-2.126 ms; per call q|k|v 7.0 against
7.5 us, gate|up 22.7 against 24.8).

The bits differ from the layers' (within bf16 rounding: the norm's 1 / rms scales the GEMV's sum
instead of rounding rmsnorm(h) to bf16 first; tests/model/test_cuda_stack.py compares the two).
It takes a model whose every layer is a LlamaDecoderLayer (Llama, Mistral, Qwen3, ...) with a
gated MLP, residual multiplier 1, norms without offset, and q|k|v, o, gate|up and down each one
q4_0 segment in the CUDA planar layout without bias or act-order, hidden size <= 4,096 (q4_ks's CTA
covers all of K), on a device where the CUDA C++ GEMV built. `build` returns None otherwise, and
`FLATSERVE_CUDA_STACK=0` keeps the Python layers (the A/B).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from flatserve.model import cuda_gemv
from flatserve.model.layers import GatedMLP
from flatserve.model.quant import QuantLinear

ENABLED = os.environ.get("FLATSERVE_CUDA_STACK", "1") != "0"
# o and down hand the next RMSNorm's elementwise half to the GEMV after them ("0": q|k|v and
# gate|up normalize h themselves, the A/B)
HANDOFF = os.environ.get("FLATSERVE_CUDA_STACK_HANDOFF", "1") != "0"
_ACTS = ("silu", "gelu_pytorch_tanh")


def _weights(lin: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(codes, scales, nblk, rows) of a one-segment planar q4_0 QuantLinear, else None."""
    if not isinstance(lin, QuantLinear) or lin.bias is not None or lin.perm.numel() \
            or not lin.use_kernel or len(lin.fmts) != 1 or lin.fmts[0].name != "q4_0" or 0 not in lin.planar:
        return None
    from flatserve.model import quant_planar  # Triton: only where a CUDA model is

    codes, scales, nblk = quant_planar._views(lin.segments()[0][1], lin.fmts[0])
    return codes, scales, nblk, lin.out_features


class _Layer:
    def __init__(self, layer: nn.Module, lins: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        self.attn, self.act = layer.self_attn, layer.mlp.act_name
        self.qkv, self.o, self.gate_up, self.down = lins
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        self.norm_in, self.norm_mlp = (n1.weight, n1.eps), (n2.weight, n2.eps)


class CudaDecoderStack:
    """Callable as `DecoderLayers.fast`: (h, residual, positions) -> (h, residual), or None for a
    step of more than one token."""

    def __init__(self, layers: list[_Layer], parts: int) -> None:
        self.layers = layers
        self.parts = parts  # o's and down's partial sums of h^2 (cuda_gemv.handoff_parts), 0: no hand-off
        self.taken = 0  # steps run (eager calls and graph captures; the tests read it)

    @staticmethod
    def _gemv(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor, int, int], out_cols: int,
              **fused) -> torch.Tensor:
        out = torch.empty(1, out_cols, dtype=x.dtype, device=x.device)
        codes, scales, nblk, n = w
        if not cuda_gemv.gemv(x, codes, scales, out, n, nblk, **fused):
            raise RuntimeError("the one-row CUDA GEMV refused a call cuda_stack.build accepted")
        return out

    def _residual(self, x: torch.Tensor, w: tuple, res: torch.Tensor, norm: tuple[torch.Tensor, float]
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, dict]]:
        """h = res + W x, and the next GEMV's input for rmsnorm(h) with `norm`: (x, its kwargs). With
        the hand-off x = bf16(h * nw) and `prenormed` (the partial sums of h^2, eps), else h itself
        with `norm`."""
        if not self.parts:
            h = self._gemv(x, w, w[3], res=res)
            return h, (h, {"norm": norm})
        hw = torch.empty(1, w[3], dtype=x.dtype, device=x.device)
        part = torch.empty(self.parts, dtype=torch.float32, device=x.device)
        h = self._gemv(x, w, w[3], res=res, norm_out=(norm[0], hw, part))
        return h, (hw, {"prenormed": (part, norm[1])})

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if h.shape[0] != 1 or h.dtype != torch.bfloat16 or residual is not None:
            return None
        g = self._gemv
        self.taken += 1
        # The normed input of the next GEMV: (x, its kwargs). Layer 0's q|k|v normalizes h itself;
        # after that, o and down hand the norm's elementwise half on where self.parts (norm_out).
        normed = (h, {"norm": self.layers[0].norm_in})
        for i, L in enumerate(self.layers):  # h [1, H]: the residual stream
            qkv = g(normed[0], L.qkv, L.qkv[3], **normed[1])
            o = L.attn.attend_qkv(qkv, positions).contiguous()  # [1, Hq D]
            h1, normed = self._residual(o, L.o, h, L.norm_mlp)
            a = g(normed[0], L.gate_up, L.gate_up[3] // 2, act=L.act, **normed[1])  # [1, I]
            if i + 1 == len(self.layers):  # the model's final norm adds (d, h1) itself
                return g(a, L.down, L.down[3]), h1
            h, normed = self._residual(a, L.down, h1, self.layers[i + 1].norm_in)
        return None  # no layers (build returns no stack for those)


def build(layers: nn.ModuleList, device: torch.device) -> CudaDecoderStack | None:
    """The stack for these decoder layers, or None where some layer does not fit (module doc)."""
    from flatserve.model.llama import LlamaDecoderLayer

    if not ENABLED or device.type != "cuda" or not len(layers) or not cuda_gemv.prepare(device):
        return None
    out = []
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer or not isinstance(layer.mlp, GatedMLP) \
                or layer.residual_multiplier != 1.0 or layer.mlp.act_name not in _ACTS:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.offset or n.weight.dtype != torch.bfloat16 for n in norms):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        lins = [_weights(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(w is None for w in lins) or not all(cuda_gemv.fused(w[3], w[2]) for w in (lins[0], lins[2])):
            return None
        out.append(_Layer(layer, lins))
    parts = cuda_gemv.handoff_parts(out[0].o[3], device, out[0].o[2], out[0].down[2]) if HANDOFF else 0
    return CudaDecoderStack(out, parts)
