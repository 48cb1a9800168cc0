"""CPU SDPA for a prefill run: 3-D [Hkv, rows, D] inputs (the math fallback) vs 4-D [1, Hkv, rows, D]
(the flash kernel), Gemma 3 270M's attention shape (4 q heads folded onto 1 KV head, head 256),
bf16, causal mask with the 512 sliding window. The evidence for the 4-D views in
flatserve/attention/torch_backend.py; ms per call and the max error of each against float64.

    .venv/bin/python benchmarks/dev/cpu_prefill_sdpa.py
"""

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.common import ms_per_call  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    hkv, g, d = 1, 4, 256
    for n, L in [(1500, 1500), (512, 1500), (2048, 2048)]:  # query rows, keys
        q = torch.randn(hkv, n * g, d, dtype=torch.bfloat16)
        k = torch.randn(hkv, L, d, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qp, kp = torch.arange(L - n, L)[:, None], torch.arange(L)[None, :]
        mask = ((kp <= qp) & (kp > qp - 512)).repeat_interleave(g, 0)  # [n*g, L]
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        e3 = (F.scaled_dot_product_attention(q, k, v, attn_mask=mask).double() - ref).abs().max()
        e4 = (F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0].double()
              - ref).abs().max()
        t3 = ms_per_call(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), n=5)
        t4 = ms_per_call(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask), n=5)
        print(f"{n} rows x {L} keys: 3-D {t3:.1f} ms (err {e3:.1e}), 4-D {t4:.1f} ms (err {e4:.1e}), "
              f"{t3 / t4:.1f}x")


if __name__ == "__main__":
    main()
