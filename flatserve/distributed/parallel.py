"""Megatron-style tensor-parallel layers. Each layer knows its own shard: `weight_loader` (or
`load_shard` for the fused ones) narrows the full checkpoint tensor to this rank's rows or
columns, so the loader stays one loop and no central list of names says what splits where.

    q|k|v, gate|up   column-parallel: this rank's heads / intermediate rows, no communication
    o, down          row-parallel: this rank's input columns, one all-reduce of [T, H] each
    embedding        vocab-parallel: rows [start, start + n); ids outside give 0; all-reduce
    LM head          vocab-parallel: [S, V / tp] per rank, all-gathered to [S, V]

KV heads: sharded when there are at least as many as ranks; else each KV head is replicated on
tp / Hkv consecutive ranks (the ranks whose query heads read it).
`shard_model` swaps these in on the meta device, before any weight is allocated, so a rank
allocates only its share. TP = 1 never calls it: the single-device model is untouched.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flatserve.distributed import quant_shards
from flatserve.distributed.group import TPGroup
from flatserve.memory import BudgetError, BudgetRequest, CacheBudget, MemoryProbe, plan
from flatserve.model.config import ModelConfig
from flatserve.model.layers import Attention, Embedding, GatedMLP, PackedLinear
from flatserve.model.quant import QuantEmbedding, QuantLinear

log = logging.getLogger("flatserve")


def _split(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({size})")
    return n // size


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    if num_kv_heads >= size:
        return _split(num_kv_heads, size, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({size}) must divide or be a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    return 1


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """What one rank holds: its query and KV heads (the KV pool and the budget read these)."""
    return dataclasses.replace(cfg, num_heads=_split(cfg.num_heads, size, "num_attention_heads"),
                               num_kv_heads=kv_heads_per_rank(cfg.num_kv_heads, size))


class ColumnPackedLinear(PackedLinear):
    """q|k|v or gate|up with the output dim sharded: each fused part holds this rank's rows of
    the checkpoint tensor, starting at `src[name]`."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int]], bias: bool,
                 full: dict[str, tuple[int, int]]) -> None:
        super().__init__(in_features, {n: size for n, (size, _) in parts.items()}, bias)
        self.src = {n: start for n, (_, start) in parts.items()}
        self.full = full  # the unsharded layer's (offset, size) per part

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        super().load_shard(param, tensor.narrow(0, self.src[shard], self.offsets[shard][1]), shard)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        """A checkpoint that stores the parts already packed (Phi-3's qkv_proj, gate_up_proj):
        each part cut out of the whole tensor, then this rank's rows of it."""
        for name, (off, size) in self.full.items():
            self.load_shard(param, tensor.narrow(0, off, size), name)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W[:, cols]^T) + b: the input dim sharded, the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        if param is self.weight:
            tensor = tensor.narrow(1, self.group.rank * self.in_features, self.in_features)
        assert param.shape == tensor.shape, f"{tuple(tensor.shape)} != {tuple(param.shape)}"
        param.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))  # [T, out]
        return y if self.bias is None else y + self.bias

    def around(self, local: nn.Module) -> nn.Module:
        """This layer with `local` (a QuantLinear of this rank's columns, no bias: --quantization)
        computing x_local @ W^T in place of the dense weight."""
        return Reduced(local, self.group, self.bias)


class Reduced(nn.Module):
    """A row-parallel linear around another module's local product: all_reduce(local(x)) + b."""

    def __init__(self, local: nn.Module, group: TPGroup, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.local, self.group, self.bias = local, group, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.local(x))  # [T, out]
        return y if self.bias is None else y + self.bias

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: object) -> None:  # the loader's hook
        self.local.load_quant(shard, raw, fmt)

    def load_perm(self, shard: str, perm: torch.Tensor) -> None:
        raise ValueError("a GPTQ checkpoint with act-order (desc_act) stores o's and down's input "
                         "columns permuted, and those do not split over tensor-parallel ranks: "
                         "serve it with tensor_parallel_size 1")


class _VocabRows:
    """Rows [start, start + n) of a vocab-sized table; the last rank's tail past V is zeros."""

    group: TPGroup
    start: int
    vocab: int
    weight: nn.Parameter

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        n = param.shape[0]
        have = max(0, min(n, self.vocab - self.start))
        param.data[have:].zero_()
        param.data[:have].copy_(tensor.narrow(0, self.start, have))


class VocabParallelEmbedding(_VocabRows, Embedding):  # no init on meta
    def __init__(self, vocab: int, dim: int, group: TPGroup) -> None:
        n = -(-vocab // group.size)  # padded: V need not divide by tp
        nn.Embedding.__init__(self, n, dim)
        self.group, self.vocab, self.start = group, vocab, group.rank * n

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(ids, self.start, self.num_embeddings, self.group,
                           lambda local: F.embedding(local, self.weight))

    def around_table(self, table: nn.Module, dtype: torch.dtype) -> nn.Module:
        """This embedding reading `table`'s rows (the tied head quantized: --quantization)."""
        return QuantVocabEmbedding(table, self.group, self.start, dtype)


class ParallelLMHead(_VocabRows, nn.Linear):
    """Each rank's logits for its vocab rows, gathered: [S, H] -> [S, V] on every rank (the
    sampler then runs on rank 0 only)."""

    def __init__(self, hidden: int, vocab: int, group: TPGroup) -> None:
        n = -(-vocab // group.size)
        nn.Linear.__init__(self, hidden, n, bias=False)
        self.group, self.vocab, self.start = group, vocab, group.rank * n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(F.linear(x, self.weight))[:, :self.vocab]  # [S, V]

    def around(self, local: nn.Module) -> nn.Module:
        """This head with `local` (a QuantLinear of this rank's vocab rows) in place of the weight."""
        return Gathered(local, self.group, self.vocab, self.start)


class Gathered(nn.Module):
    """A vocab-parallel LM head around another module's local logits: [S, H] -> [S, V]. `local`
    is also the tied embedding's table (VocabParallelEmbedding.around_table)."""

    def __init__(self, local: nn.Module, group: TPGroup, vocab: int, start: int) -> None:
        super().__init__()
        self.local, self.group, self.vocab, self.start = local, group, vocab, start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.local(x))[:, :self.vocab]  # [S, V]

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: object) -> None:
        self.local.load_quant(shard, raw, fmt)


class QuantVocabEmbedding(nn.Module):
    """VocabParallelEmbedding reading a quantized table's rows (the tied head's QuantLinear)."""

    def __init__(self, table: nn.Module, group: TPGroup, start: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.table, self.group, self.start, self.dtype = table, group, start, dtype

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: object) -> None:
        self.table.load_quant(shard, raw, fmt)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        def rows(local: torch.Tensor) -> torch.Tensor:
            h = self.table.dequant_rows(local)
            return h if self.dtype is None else h.to(self.dtype)

        return _vocab_rows(ids, self.start, self.table.out_features, self.group, rows)


def _vocab_rows(ids: torch.Tensor, start: int, n: int, group: TPGroup, lookup: Any) -> torch.Tensor:
    """[T] ids -> [T, H]: this rank's rows [start, start + n) looked up, ids outside give 0, summed
    over the ranks (each id is inside exactly one rank's rows)."""
    local = ids - start
    outside = (local < 0) | (local >= n)
    h = lookup(local.masked_fill(outside, 0))  # [T, H]
    return group.all_reduce(h.masked_fill_(outside[:, None], 0))


def _column(old: nn.Module, parts: dict[str, tuple[int, int]]) -> nn.Module:
    """q|k|v or gate|up: this rank's rows of each part, dense or as stored blocks."""
    if isinstance(old, QuantLinear):
        return quant_shards.ColumnQuantLinear(old, parts)
    return ColumnPackedLinear(old.in_features, parts, old.bias is not None, old.offsets)


def _row(old: nn.Module, k: int, g: TPGroup) -> nn.Module:
    """o or down: this rank's k input columns, dense or as stored blocks, then the all-reduce."""
    if isinstance(old, QuantLinear):
        return Reduced(quant_shards.RowQuantLinear(old, g.rank, g.size), g, old.bias)
    return RowParallelLinear(k, old.out_features, old.bias is not None, g)


def _shard_attention(a: Attention, g: TPGroup) -> None:
    if getattr(a, "sinks", None) is not None:
        raise ValueError("attention sinks (GPT-OSS) are not split over tensor-parallel ranks yet")
    hq = _split(a.hq, g.size, "num_attention_heads")
    hkv = kv_heads_per_rank(a.hkv, g.size)
    # KV head of this rank: its own slice, or (replicated) the one its query heads read.
    kv0 = g.rank * hkv if a.hkv >= g.size else g.rank // (g.size // a.hkv)
    a.qkv_proj = _column(a.qkv_proj, {"q_proj": (hq * a.d, g.rank * hq * a.d),
                                      "k_proj": (hkv * a.d, kv0 * a.d), "v_proj": (hkv * a.d, kv0 * a.d)})
    a.o_proj = _row(a.o_proj, hq * a.d, g)
    a.hq, a.hkv = hq, hkv


def _shard_mlp(m: GatedMLP, g: TPGroup) -> None:
    inter = _split(m.down_proj.in_features, g.size, "intermediate_size")
    m.gate_up_proj = _column(m.gate_up_proj, {"gate_proj": (inter, g.rank * inter),
                                              "up_proj": (inter, g.rank * inter)})
    m.down_proj = _row(m.down_proj, inter, g)


def shard_model(model: nn.Module, g: TPGroup) -> None:
    """In place, on the meta device: every attention, gated MLP, the embedding and the LM head
    become this rank's shard. Anything else (norms, rotary, MoE experts for now) stays replicated:
every rank computes it whole, so the tokens are the same, only the memory is not split."""
    for m in list(model.modules()):
        if isinstance(m, Attention):
            _shard_attention(m, g)
        elif isinstance(m, GatedMLP):
            _shard_mlp(m, g)
    inner = model.model
    emb, head = inner.embed_tokens, model.lm_head
    if isinstance(head, QuantLinear):  # a GGUF kept quantized: blocks, not dense rows
        n = -(-head.out_features // g.size)
        table = quant_shards.VocabQuantRows(head, n, g.rank * n, head.out_features)
        model.lm_head = Gathered(table, g, head.out_features, g.rank * n)
    else:
        model.lm_head = ParallelLMHead(head.in_features, head.out_features, g)
    if isinstance(emb, QuantEmbedding):
        n = -(-emb.lin.out_features // g.size)
        own = table if emb.lin is head else \
            quant_shards.VocabQuantRows(emb.lin, n, g.rank * n, emb.lin.out_features)
        inner.embed_tokens = QuantVocabEmbedding(own, g, g.rank * n, emb.dtype)
    else:
        inner.embed_tokens = VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, g)
        if model.cfg.tie_word_embeddings and isinstance(model.lm_head, ParallelLMHead):
            model.lm_head.weight = inner.embed_tokens.weight


def host_share(probe: MemoryProbe, g: TPGroup) -> MemoryProbe:
    """Unified memory (the CPU): the ranks on one host share its RAM, so each budgets its share;
    a GPU rank owns its device."""
    if not probe.unified or g.topo.local_size == 1:
        return probe
    n = g.topo.local_size
    return dataclasses.replace(probe, total=probe.total // n, available=probe.available // n,
                               device=f"{probe.device} (1/{n} per rank)")


def agree_budget(probe: MemoryProbe, req: BudgetRequest, g: TPGroup) -> CacheBudget:
    """Each rank plans its own budget; the group keeps the smallest block count (one block id
    addresses the same block in every rank's pool). A rank that cannot fit fails every rank."""
    try:
        mine: CacheBudget | None = plan(probe, req)
    except BudgetError as e:
        err, mine = e, None
    n = g.min_int(mine.num_blocks if mine is not None else 0)
    if mine is None:
        raise err
    if n == 0:
        raise BudgetError("another tensor-parallel rank cannot fit its KV cache (its start-up "
                          "line says why); this rank could")
    budget = mine if n == mine.num_blocks else plan(
        probe, dataclasses.replace(req, num_blocks_override=n, max_num_seqs=None))
    log.info("rank %d/%d: %s", g.rank, g.size, budget.startup_line())
    return budget
