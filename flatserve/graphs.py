"""CUDA graphs for decode-only steps: one graph per batch-size bucket, static buffers, padding.

Padded rows (bucket size > real sequences) carry slot -1 (the KV write skips them), context
length 1 over the null block 0, and their logits are never read. The attention metadata's host
fields are baked at capture (max_q_len 1, num_seqs = bucket), and so is each layer's split-KV
factor, which the attention kernel chooses at capture from the bucket and that layer's KV heads
by the rule an eager decode step of that batch uses (unified_attention.choose_segments), so both
give the same bits; each program finds its tiles from the device's sequence lengths, so a split
baked at capture is right for any length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flatserve.attention.metadata import AttentionMetadata, forward_context


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 8))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


@dataclass(slots=True)
class GraphBuffers:
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [B] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32 = arange
    logits: torch.Tensor | None = None  # [B, V], written by the graphs


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        B = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.buf = GraphBuffers(
            input_ids=torch.zeros(B, dtype=torch.int64, device=device),
            positions=torch.zeros(B, dtype=torch.int64, device=device),
            seq_lens=torch.ones(B, **i32), block_table=torch.zeros(B, max_blocks, **i32),
            slot_mapping=torch.full((B,), -1, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.arange(B + 1, **i32))
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # The capture stream is this device's own: torch.cuda.graph's default is one stream per
        # process, made on whichever device captured first, and entering it makes that device
        # current, so a second engine on another GPU (data-parallel replicas are threads of one
        # process) captured its kernels against the first one's device and failed.
        self.stream = torch.cuda.Stream(device)

    def _meta(self, b: int) -> AttentionMetadata:
        f = self.buf
        return AttentionMetadata(
            cu_seqlens_q=f.cu_seqlens_q[:b + 1], seq_lens=f.seq_lens[:b], block_table=f.block_table[:b],
            slot_mapping=f.slot_mapping[:b], max_q_len=1, max_seq_len=self.max_model_len,
            cu_seqlens_q_host=list(range(b + 1)), seq_lens_host=[self.max_model_len] * b)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
            meta = self._meta(b)
            run = lambda: self.model.compute_logits(  # noqa: E731
                self.model(self.buf.input_ids[:b], self.buf.positions[:b]))
            with forward_context(meta):
                run()  # warm-up: Triton compiles and rotary tables are built outside capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=self.stream):
                    self.outputs[b] = run()  # [b, V]
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    @torch.inference_mode()
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
               ) -> torch.Tensor:
        """Copy the step's tensors into the static buffers, pad, replay; logits [S, V]."""
        S = input_ids.shape[0]
        b = self.bucket(S)
        assert b is not None
        f = self.buf
        nb = meta.block_table.shape[1]
        f.input_ids[:S].copy_(input_ids)
        f.positions[:S].copy_(positions)
        f.seq_lens[:S].copy_(meta.seq_lens)
        f.block_table[:S, :nb].copy_(meta.block_table)
        f.slot_mapping[:S].copy_(meta.slot_mapping)
        if b > S:  # padded rows: harmless reads of the null block, no KV writes
            f.input_ids[S:b].zero_()
            f.positions[S:b].zero_()
            f.seq_lens[S:b].fill_(1)
            f.block_table[S:b].zero_()
            f.slot_mapping[S:b].fill_(-1)
        self.graphs[b].replay()
        return self.outputs[b][:S]
