"""CPU prefill attention: the torch backend's `attend_one` against the one-call form it replaced
(GQA folded onto the KV head's rows, an explicit [rows, keys] mask, one SDPA call), same inputs,
same run; ms per call and each one's max error against float64.

    .venv/bin/python benchmarks/cpu_prefill_attention.py

Shapes: Gemma 3 270M (4 q heads on 1 KV head, head 256; its local layers' 512 window and its
global layers) and Qwen3-0.6B (16 q heads on 8 KV heads, head 128); bf16; a whole prompt from
position 0 and a 512-token chunk continuing a context.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.timing import ms_per_call  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from flatserve.attention.torch_backend import attend_one  # noqa: E402


def folded_one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                    p: LayerAttnParams) -> torch.Tensor:
    """The previous form: [Hkv, n*g, D] rows against each KV head's keys, masked, one call."""
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    qh = q.view(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)
    qp = torch.arange(q_start, q_start + n)[:, None]
    kp = torch.arange(k_start, k_start + L)[None, :]
    mask = kp <= qp
    if p.sliding_window is not None:
        mask &= kp > qp - p.sliding_window
    out = F.scaled_dot_product_attention(qh[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask.repeat_interleave(g, 0), scale=p.scale)[0]
    return out.view(hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, hq, d)


def main() -> None:
    torch.manual_seed(0)
    cases = [  # name, Hq, Hkv, D, window, query rows, context before them
        ("gemma local, prompt 1006", 4, 1, 256, 512, 1006, 0),
        ("gemma local, prompt 1500", 4, 1, 256, 512, 1500, 0),
        ("gemma local, prompt 400", 4, 1, 256, 512, 400, 0),
        ("gemma global, prompt 1006", 4, 1, 256, None, 1006, 0),
        ("gemma global, prompt 2048", 4, 1, 256, None, 2048, 0),
        ("gemma global, 512 after 988", 4, 1, 256, None, 512, 988),
        ("qwen3-0.6b, prompt 1006", 16, 8, 128, None, 1006, 0),
        ("qwen3-0.6b, 512 after 988", 16, 8, 128, None, 512, 988),
    ]
    for name, hq, hkv, d, win, n, ctx in cases:
        p = LayerAttnParams(d ** -0.5, win)
        k_start = 0 if win is None else max(0, ctx - win + 1)
        L = ctx + n - k_start
        q = torch.randn(n, hq, d, dtype=torch.bfloat16)
        k = torch.randn(L, hkv, d, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ref = attend_one(q.double(), k.double(), v.double(), ctx, k_start, p)
        e_old = (folded_one_call(q, k, v, ctx, k_start, p).double() - ref).abs().max().item()
        e_new = (attend_one(q, k, v, ctx, k_start, p).double() - ref).abs().max().item()
        t_old = ms_per_call(lambda: folded_one_call(q, k, v, ctx, k_start, p), n=5)
        t_new = ms_per_call(lambda: attend_one(q, k, v, ctx, k_start, p), n=5)
        print(f"{name:30s} one masked call {t_old:6.1f} ms (err {e_old:.1e}), attend_one "
              f"{t_new:6.1f} ms (err {e_new:.1e}), {t_old / t_new:.2f}x", flush=True)


if __name__ == "__main__":
    main()
