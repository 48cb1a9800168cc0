"""Tensor-parallel shards of block-format linears (a GGUF kept quantized): parallel.py's splits,
cut from the stored blocks at load instead of from dense tensors.

    q|k|v, gate|up   ColumnQuantLinear: this rank's rows of each part (whole rows of blocks)
    o, down          RowQuantLinear: this rank's input columns, i.e. its bytes of every row; the
                     columns must be whole blocks (32 values, 256 for the K formats)
    LM head, table   VocabQuantRows: rows [start, start + n), the last rank's tail past V zero
                     blocks (scale 0: every value 0)

Each load_quant copies its slice (`clone`): QuantLinear adopts a contiguous tensor as its
buffer, and a view would keep the whole checkpoint tensor alive on every rank.
"""
from __future__ import annotations

import torch
from torch import nn

from flatserve.model.qformats import Format
from flatserve.model.quant import QuantLinear


class ColumnQuantLinear(QuantLinear):
    """`old`'s parts (name -> (rows, first row in the checkpoint tensor)) in their formats."""

    def __init__(self, old: QuantLinear, parts: dict[str, tuple[int, int]]) -> None:
        fmts = {n: old.fmts[old.offsets[n][0]] for n in parts}
        super().__init__(old.in_features, {n: (rows, fmts[n]) for n, (rows, _) in parts.items()},
                         old.bias is not None)
        self.src = {n: start for n, (_, start) in parts.items()}

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: Format) -> None:
        rows = self.offsets[shard][2]
        super().load_quant(shard, raw.narrow(0, self.src[shard], rows).clone(), fmt)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        super().load_shard(param, tensor.narrow(0, self.src[shard], self.offsets[shard][2]), shard)


class RowQuantLinear(QuantLinear):
    """`old` (one format) with its input columns split over `size` ranks; no bias (the
    all-reduce around it adds it once)."""

    def __init__(self, old: QuantLinear, rank: int, size: int) -> None:
        if len(old.fmts) != 1:
            raise ValueError("a row-parallel linear stored in more than one format")
        fmt, k = old.fmts[0], old.in_features // size
        if k % fmt.block:
            raise ValueError(f"{k} input columns per tensor-parallel rank are not whole {fmt.name} "
                             f"blocks of {fmt.block}: serve this GGUF with --dequantize")
        super().__init__(k, {"": (old.out_features, fmt)}, False)
        self.rank = rank

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: Format) -> None:
        nbytes = fmt.row_bytes(self.in_features)
        super().load_quant(shard, raw.narrow(1, self.rank * nbytes, nbytes).contiguous(), fmt)


class VocabQuantRows(QuantLinear):
    """Rows [start, start + n) of `old`'s vocab-sized table of `vocab` rows."""

    def __init__(self, old: QuantLinear, n: int, start: int, vocab: int) -> None:
        if len(old.fmts) != 1:
            raise ValueError("a vocab table stored in more than one format")
        super().__init__(old.in_features, {"": (n, old.fmts[0])}, False)
        self.start, self.vocab = start, vocab

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: Format) -> None:
        n = self.out_features
        have = max(0, min(n, self.vocab - self.start))
        rows = raw.new_zeros(n, raw.shape[1])
        rows[:have] = raw[self.start:self.start + have]
        super().load_quant(shard, rows, fmt)
