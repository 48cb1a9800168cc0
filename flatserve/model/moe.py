"""The sparse MLP block (Qwen3-MoE, GPT-OSS) beside the dense `GatedMLP`, and its three paths:

- `moe_ref`: the torch reference, a loop over experts as transformers runs it;
- `moe_grouped` (CPU): the (token, expert) pairs sorted by expert once per layer, each routed
  expert's weights read once for all its tokens, the weighted sum scattered back in token order;
- `flatserve.ops.fused_moe` (CUDA, Triton): fused routing, one grouped GEMM launch for gate_up
  (activation in its epilogue) and one for down over all experts; no host sync (CUDA graphs).

Expert weights are kept as F.linear weights: gate_up [E, 2I, H] (gate rows, then up rows, like
`GatedMLP.gate_up_proj`), down [E, H, I]. `load_hf_tensor` takes the checkpoints' layouts:
Qwen3-MoE's per-expert linears, GPT-OSS's [E, H, 2I] with gate/up interleaved (bf16 or MXFP4
blocks + scales) and the GGUF experts' [E, I, H] stacks.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flatserve.model.config import ModelConfig, MoeConfig
from flatserve.model.layers import ACTIVATIONS


def route(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, moe: MoeConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k] int64), HF's order of ops."""
    logits = F.linear(x, w, b)  # [T, E]
    if moe.router == "topk_softmax":  # GPT-OSS: top-k of the logits, softmax over those k
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # Qwen3-MoE: over all experts
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def expert_act(gu: torch.Tensor, moe: MoeConfig, act: Callable[[torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
    """gate_up rows [n, 2I] -> [n, I]: act(gate) * up, or GPT-OSS's clamped SwiGLU
    (gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1))."""
    gate, up = gu.chunk(2, dim=-1)
    if moe.swiglu_limit is None:
        return act(gate) * up
    gate = gate.clamp(max=moe.swiglu_limit)
    up = up.clamp(-moe.swiglu_limit, moe.swiglu_limit)
    return gate * torch.sigmoid(gate * moe.swiglu_alpha) * (up + 1)


class MoeMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        E, H, I = moe.num_experts, cfg.hidden_size, moe.intermediate_size
        self.moe, self.act = moe, ACTIVATIONS[cfg.hidden_act]
        self.router_weight = nn.Parameter(torch.empty(E, H))
        self.router_bias = nn.Parameter(torch.empty(E)) if moe.router_bias else None
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        self.b_gate_up = nn.Parameter(torch.empty(E, 2 * I)) if moe.expert_bias else None
        self.b_down = nn.Parameter(torch.empty(E, H)) if moe.expert_bias else None
        self.path = "auto"  # auto | ref | grouped | triton (tests pin one)
        self._mx: dict[str, torch.Tensor] = {}  # MXFP4 blocks waiting for their scales

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        return (self.router_weight, self.router_bias, self.w_gate_up, self.b_gate_up,
                self.w_down, self.b_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path
        if path == "auto":
            path = "triton" if x.is_cuda else "grouped"
        if path == "triton":
            from flatserve.ops.fused_moe import fused_moe

            return fused_moe(x, *self.weights(), self.moe)
        fn = moe_grouped if path == "grouped" else moe_ref
        return fn(x, *self.weights(), self.moe, self.act)

    # ---- checkpoint layouts -> ours (called by model/loader.py for names under this module)
    def load_hf_tensor(self, name: str, t: torch.Tensor) -> list[str]:
        """-> the names (param or param:shard) this tensor filled; ValueError if it has no place."""
        I = self.moe.intermediate_size
        if name in ("gate.weight", "router.weight"):
            return self._put("router_weight", t)
        if name == "router.bias":
            return self._put("router_bias", t)
        if m := re.fullmatch(r"experts\.(\d+)\.(gate|up|down)_proj\.weight", name):  # Qwen3-MoE
            e, which = int(m.group(1)), m.group(2)
            if which == "down":
                return self._put("w_down", t, e)
            return self._put("w_gate_up", t, e, (0 if which == "gate" else I, I))
        if m := re.fullmatch(r"experts\.(gate|up|down)_exps(_bias)?", name):  # GGUF stacks
            which, bias = m.group(1), bool(m.group(2))
            if which == "down":
                return self._put("b_down" if bias else "w_down", t)
            off = (0 if which == "gate" else I, I)
            return self._put("b_gate_up" if bias else "w_gate_up", t, None, off)
        if name.endswith(("_blocks", "_scales")):  # GPT-OSS MXFP4: dequantized once both are in
            self._mx[name] = t
            base = name.rsplit("_", 1)[0]
            if f"{base}_blocks" not in self._mx or f"{base}_scales" not in self._mx:
                return []
            w = dequant_mxfp4(self._mx.pop(f"{base}_blocks"), self._mx.pop(f"{base}_scales"))
            return self.load_hf_tensor(base, w.transpose(-1, -2))  # [E, out, in] -> HF's [E, in, out]
        if name == "experts.gate_up_proj":  # GPT-OSS [E, H, 2I], gate/up interleaved; Qwen3 [E, 2I, H]
            if self.moe.swiglu_limit is not None:
                t = torch.cat([t[..., ::2], t[..., 1::2]], -1).transpose(1, 2)
            return self._put("w_gate_up", t)
        if name == "experts.gate_up_proj_bias":
            return self._put("b_gate_up", torch.cat([t[..., ::2], t[..., 1::2]], -1))
        if name == "experts.down_proj":  # GPT-OSS [E, I, H]; Qwen3 [E, H, I]
            return self._put("w_down", t.transpose(1, 2) if self.moe.swiglu_limit is not None else t)
        if name == "experts.down_proj_bias":
            return self._put("b_down", t)
        raise ValueError(f"checkpoint tensor {name!r} has no place in the MoE block")

    def _put(self, pname: str, t: torch.Tensor, expert: int | None = None,
             rows: tuple[int, int] | None = None) -> list[str]:
        p = getattr(self, pname)
        if p is None:
            raise ValueError(f"checkpoint has {pname!r}, which this configuration does not use")
        dst = p.data if expert is None else p.data[expert]
        if rows is not None:
            dst = dst.narrow(-2 if dst.dim() > 1 and "w_" in pname else -1, *rows)
        assert dst.shape == t.shape, f"{pname}: {tuple(t.shape)} != {tuple(dst.shape)}"
        dst.copy_(t)
        return [pname if expert is None and rows is None else f"{pname}:{expert}:{rows}"]


def moe_ref(x: torch.Tensor, rw: torch.Tensor, rb: torch.Tensor | None, wgu: torch.Tensor,
            bgu: torch.Tensor | None, wd: torch.Tensor, bd: torch.Tensor | None, moe: MoeConfig,
            act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The reference: transformers' loop, each expert finding its tokens by a full scan."""
    w, ids = route(x, rw, rb, moe)  # [T, k]
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = expert_act(F.linear(x[tok], wgu[e], None if bgu is None else bgu[e]), moe, act)
        y = F.linear(h, wd[e], None if bd is None else bd[e])  # [n, H]
        out.index_add_(0, tok, (y * w[tok, slot, None]).to(x.dtype))
    return out


def moe_grouped(x: torch.Tensor, rw: torch.Tensor, rb: torch.Tensor | None, wgu: torch.Tensor,
                bgu: torch.Tensor | None, wd: torch.Tensor, bd: torch.Tensor | None,
                moe: MoeConfig, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """CPU: one sort of the T*k (token, expert) pairs by expert, then one contiguous GEMM pair
    per routed expert over all its rows (its weights read once per step, never per token; the
    reference's per-expert scans of [T, k] are gone), the weighted rows added back by token."""
    T, H = x.shape
    k = moe.top_k
    w, ids = route(x, rw, rb, moe)  # [T, k]
    flat = ids.flatten()  # [T*k] pair p = token p // k, slot p % k
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()  # host ints (CPU: no sync)
    tok = order // k
    xs = x[tok]  # [T*k, H] rows in expert order
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = expert_act(F.linear(xs[start:start + n], wgu[e], None if bgu is None else bgu[e]),
                           moe, act)  # [n, I]
            ys[start:start + n] = F.linear(h, wd[e], None if bd is None else bd[e])
            start += n
    ys *= w.flatten()[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tok, ys)


# FP4 (e2m1) code -> value; MXFP4 = 32 such codes (two per byte, low nibble first) sharing one
# power-of-two scale byte (e8m0, bias 127): the OCP MX format GPT-OSS ships its experts in.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> fp32 [..., G * 32]."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)  # [..., G, 32]
    vals = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127)
    return vals.flatten(-2)


def mlp_for(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MLP: the sparse block where the config makes this layer sparse, else dense."""
    from flatserve.model.layers import GatedMLP

    if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
        return MoeMLP(cfg)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
