"""FlexAttention over the paged cache: the second PyTorch peer of benchmarks/attention_kernels.py.

The cache is viewed in place as one long sequence `[1, Hkv, num_blocks * 16, D]`; each sequence is
a batch row of the query `[S, Hq, max_q_len, D]` (queries padded to the longest run), and the
block mask lists, per (sequence, 128-query block), the physical 16-token pages it reads (its
block-table row), with the pages wholly below the causal diagonal marked full so only the
diagonal pages evaluate the mask. This is the layout of torch's experimental PagedAttention; the
mask_mod maps a physical slot back to its logical position through a page -> logical map.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

Q_BLOCK = 128


def _block_lists(q_lens: list[int], seq_lens: list[int], table: np.ndarray, bs: int, W: int
                 ) -> tuple[np.ndarray, ...]:
    """Per (seq, q block): counts and physical page ids of partial and full pages.

    Index rows are W = num_blocks wide (as torch's PagedAttention makes them): BlockMask sizes
    its dense form by this width, and physical page ids run up to num_blocks - 1."""
    S, rows = len(q_lens), -(-max(q_lens) // Q_BLOCK)
    kv_n = np.zeros((S, 1, rows), np.int32)
    kv_i = np.zeros((S, 1, rows, W), np.int32)
    full_n = np.zeros((S, 1, rows), np.int32)
    full_i = np.zeros((S, 1, rows, W), np.int32)
    for s, (n, L) in enumerate(zip(q_lens, seq_lens)):
        ctx = L - n
        for r in range(-(-n // Q_BLOCK)):
            first = ctx + r * Q_BLOCK  # position of the block's first and last query
            last = ctx + min(n, (r + 1) * Q_BLOCK) - 1
            nfull = (first + 1) // bs  # pages every row of the block sees whole
            nall = last // bs + 1
            full_n[s, 0, r] = nfull
            full_i[s, 0, r, :nfull] = table[s, :nfull]
            kv_n[s, 0, r] = nall - nfull
            kv_i[s, 0, r, :nall - nfull] = table[s, nfull:nall]
    return kv_n, kv_i, full_n, full_i


def make_flex_runner(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta, scale: float
                     ) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """-> (run: the timed call, unpack: its output back on the flat [T, Hq, D] axis)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    cu, seq_lens = meta.cu_seqlens_q_host, meta.seq_lens_host
    q_lens = [cu[i + 1] - cu[i] for i in range(len(seq_lens))]
    S, Qm = len(q_lens), max(q_lens)
    NB, bs, Hkv, D = kc.shape
    Hq = q.shape[1]
    dev = q.device
    table = meta.block_table.cpu().numpy()
    # Padded queries (the padding copy is set-up, not timed; a flex engine would keep this layout).
    qq = torch.zeros(S, Hq, Qm, D, dtype=q.dtype, device=dev)
    for i, n in enumerate(q_lens):
        qq[i, :, :n] = q[cu[i]:cu[i] + n].transpose(0, 1)
    k = kc.view(NB * bs, Hkv, D).permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, N, D], a view in place
    v = vc.view(NB * bs, Hkv, D).permute(1, 0, 2).unsqueeze(0)
    p2l = torch.full((S, NB), -1, dtype=torch.int32)
    for i, L in enumerate(seq_lens):
        n = -(-L // bs)
        p2l[i, torch.from_numpy(table[i, :n]).long()] = torch.arange(n, dtype=torch.int32)
    p2l = p2l.to(dev)
    ctx = torch.tensor([L - n for n, L in zip(q_lens, seq_lens)], dtype=torch.int32, device=dev)
    qlen = torch.tensor(q_lens, dtype=torch.int32, device=dev)

    def mask_mod(b, h, q_idx, kv_idx):
        logical = p2l[b, kv_idx // bs] * bs + kv_idx % bs
        return (p2l[b, kv_idx // bs] >= 0) & (logical <= ctx[b] + q_idx) & (q_idx < qlen[b])

    kv_n, kv_i, full_n, full_i = (torch.from_numpy(a).to(dev) for a in _block_lists(q_lens, seq_lens, table, bs, NB))
    bm = BlockMask.from_kv_blocks(kv_n, kv_i, full_n, full_i, BLOCK_SIZE=(Q_BLOCK, bs),
                                  mask_mod=mask_mod, seq_lengths=(Qm, NB * bs))
    fn = torch.compile(flex_attention, dynamic=False)
    opts = {"BLOCK_N": bs}  # a kernel KV tile may not exceed the 16-token page

    def run() -> torch.Tensor:
        return fn(qq, k, v, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=opts)

    def unpack(o: torch.Tensor) -> torch.Tensor:
        return torch.cat([o[i, :, :n].transpose(0, 1) for i, n in enumerate(q_lens)])

    return run, unpack
