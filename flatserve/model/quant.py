"""Linears whose weights stay in a GGUF block format (flatserve/model/qformats.py): a GGUF's own
tensors served as stored (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, any mix as in Q4_K_M files), and
`--quantization q8_0 | q4_0 | int8` for float checkpoints (int8 is q8_0: 8-bit codes with one
scale per 32 values, the same code path).

Why: a CPU decode step is weight-read bound. Dequantized to bf16 the default model reads 2-4x the
bytes per token of its Q4_K_M file and holds 2-3x the memory (issue #30's figures).

A `QuantLinear` holds its rows as segments of one format each (q|k|v or gate|up fuse at load,
and a Q4_K_M file may store v in Q8_0 beside q and k in Q5_0). On the CPU the C++ kernel
(ops/csrc/quant_gemm_cpu.cpp) reads the blocks in place, with generated tokens' activations
quantized to int16 codes per 32 values; elsewhere, or without a compiler, `reference`
dequantizes slices in torch and runs the dense matmul. A tied LM head and the embedding share one table: the embedding
dequantizes the rows it looks up.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flatserve import device as dev
from flatserve.attention import metadata
from flatserve.kernel_build import CpuKernel
from flatserve.model.qformats import FORMATS, Format, dequantize, quantize

log = logging.getLogger("flatserve")

_SRC = Path(__file__).parents[1] / "ops" / "csrc" / "quant_gemm_cpu.cpp"
_ext = CpuKernel("flatserve_quant_gemm_cpu", _SRC,
                  "quantized linears dequantize slices in torch", levels=dev.ISA_LEVELS)  # avxvnni too
SLICE_BYTES = 4 << 20  # reference path: fp32 rows dequantized at a time
# Prompt tokens' rows (and, outside a step, calls of PROMPT_ROWS rows or more): the kernel
# dequantizes up to DENSE_BYTES of fp32 weight rows at a time (C++, the reference's bits; every
# linear of the default model in one piece) and torch's dense GEMM runs on them. The quantized
# dot spends ~9 AVX2 instructions per 32 products, fp32 FMA 4, so prompt chunks are compute-bound
# either way and the dense GEMM computes with unquantized activations. One piece per linear, not
# one per 256 rows (each piece re-read the activation chunk and wrote a strided slice of the
# output): the default GGUF's four layer linears on a 2,048-token chunk 274 -> 245 ms (2-core EPYC).
# Generated tokens' rows take the int16-activation kernel (_generated_rows); below AVX-512 prompt
# rows do too (PROMPT_INT16_LEVELS).
PROMPT_ROWS = 32
DENSE_BYTES = 16 << 20
ROW_TILE = 128  # the float GEMM runs in calls of this many rows: see _dense_rows
# Generated rows' activations: int16 codes, one fp32 scale per 32 values, each block's codes
# stored in this order (ops/csrc/quant_gemm_cpu.cpp says why). int8 codes (llama.cpp's q8
# activations) gave 95.9% teacher-forced top-1 agreement on the default GGUF, below
# tests/model/test_quant_fidelity.py's 99% bar; int16 codes err 258x less for the same number of
# multiplies per weight (one vpmaddwd per 16 products on AVX2).
ACT_ORDER = tuple(range(8)) + tuple(range(16, 24)) + tuple(range(8, 16)) + tuple(range(24, 32))
QUANTIZATIONS = ("int8", "q8_0", "q4_0")  # --quantization for float checkpoints
AUTO, TILES = 0, 2  # the kernel's gemm `path`: by row count, or the tiles forced
# Prompt rows below AVX-512 (the avx2 and avxvnni builds) take the int16 codes too, on the tiles in
# 256-bit lanes (csrc/quant_tiles_ymm.h; rows8 for calls of a few rows, the same bits), instead of
# the dense fp32 GEMM, whose MKL runs 8 multiply-adds an FMA there (AVX2; also on AMD CPUs that
# have AVX-512: MKL's path for them). At 256 and 2,048 rows the default GGUF's linears' shapes
# took 0.47-0.66x the dense path's time (dequantize + GEMM) at avxvnni and 0.52-0.84x at avx2,
# every format (`FLATSERVE_CPU_ISA=... benchmarks/dev/cpu_prompt_tiles.py`, 2-core Zen 5,
# 2026-11-28). At avx512 (AVX512-BF16) the dense bf16 GEMM stays: there the tiles took 1.30-1.83x
# its time (same script).
PROMPT_INT16_LEVELS = dev.AVX2_LEVELS


# Without AMX (the avx512 level: AMD Zen 4) the formats whose calls take the tiles' bits: rows16
# (csrc/quant_rows.h) at a few rows, the tiles in VNNI lanes (csrc/quant_vnni.h) above; the others
# take the AVX2 kernels, whose bits differ. All of them: on a real 2-core Zen 4 (2026-11-28,
# benchmarks/dev/cpu_profile_step.py N --by-kernel) 16-request decode steps took 52-67 ms against
# 99-100 on the default then (q4_k alone), and one-request steps 13.8-15.5 against 16.0-23.3 once
# rows16 prefetched its rows (ops/csrc/quant_gemm_cpu.cpp, stream_bytes), so every call's bits are
# the same whatever its row count. FLATSERVE_QUANT_ROWS16 ("all", "none" or format names; empty
# is the default) overrides, for A/Bs.
ROWS16_FORMATS = os.environ.get("FLATSERVE_QUANT_ROWS16") or "all"
_rows16_set: set[int] = set()


def prompt_int16(ext: Any) -> bool:
    """Whether this build's prompt rows take the int16 codes (PROMPT_INT16_LEVELS)."""
    return ext.isa() in PROMPT_INT16_LEVELS


def kernel() -> object | None:
    ext = _ext()
    if ext is not None and id(ext) not in _rows16_set:
        names = {"all": FORMATS, "none": ()}.get(ROWS16_FORMATS, ROWS16_FORMATS.split(","))
        if set(names) - set(FORMATS):
            raise ValueError(f"FLATSERVE_QUANT_ROWS16={ROWS16_FORMATS!r}: not all, none or format names "
                             f"from {', '.join(FORMATS)}")
        ext.set_rows16_formats(sum(1 << min(FORMATS[n].ggml_type, 62) for n in names))  # q4_g: 100
        _rows16_set.add(id(ext))
    return ext


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias), W [N, K] as row segments of GGUF blocks (uint8 buffers `qweight{i}`).

    `shards`: name -> (rows, format), in output order ("" for a plain linear); consecutive shards
    of one format share a segment."""

    def __init__(self, in_features: int, shards: dict[str, tuple[int, Format]],
                 bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(r for r, _ in shards.values())
        self.fmts: list[Format] = []
        self.offsets: dict[str, tuple[int, int, int]] = {}  # shard -> (segment, first row, rows)
        rows: list[int] = []
        for name, (n, fmt) in shards.items():
            if not self.fmts or self.fmts[-1] != fmt:
                self.fmts.append(fmt)
                rows.append(0)
            self.offsets[name] = (len(self.fmts) - 1, rows[-1], n)
            rows[-1] += n
        for i, (n, fmt) in enumerate(zip(rows, self.fmts)):
            self.register_buffer(f"qweight{i}", torch.empty(n, fmt.row_bytes(in_features), dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        # GPTQ act-order: the input order the blocks are stored in (x[:, perm]); empty: as is.
        self.register_buffer("perm", torch.empty(0, dtype=torch.int64))
        self.loaded: set[str] = set()
        self.use_kernel = True  # False: the torch reference (tests)
        self.packed: torch.Tensor | None = None  # pack(): the decoder stack's one-tensor form
        # Segments whose buffer holds quant_planar's GPU layout (q4_0 / q8_0 on CUDA, made once
        # the segment's last shard is loaded): the CUDA kernels' copy, in place of the blocks.
        self.planar: set[int] = set()

    def segments(self) -> list[tuple[Format, torch.Tensor]]:
        """(format, buffer) per segment; a buffer in `planar` is not blocks (blocks() is)."""
        return [(f, getattr(self, f"qweight{i}")) for i, f in enumerate(self.fmts)]

    def blocks(self, i: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Segment i's GGUF blocks (rows `rows`), from the planar copy where it is one."""
        q = getattr(self, f"qweight{i}")
        if i in self.planar:
            from flatserve.model import quant_planar

            return quant_planar.to_blocks(q, self.fmts[i], rows)
        return q if rows is None else q[rows]

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: Format) -> None:
        seg, row, n = self.offsets[shard]
        dst = getattr(self, f"qweight{seg}")
        assert fmt == self.fmts[seg] and raw.shape == (n, dst.shape[1]), \
            f"{shard or 'weight'}: {fmt.name} {tuple(raw.shape)} != {self.fmts[seg].name} ({n}, {dst.shape[1]})"
        if dst.device.type not in ("meta", raw.device.type):  # a GPU model's blocks read on the host
            raw = raw.to(dst.device)
        if n == dst.shape[0] and raw.is_contiguous():
            setattr(self, f"qweight{seg}", raw)  # adopt: no second copy
        else:
            dst[row:row + n].copy_(raw)
        self.loaded.add(shard)
        q = getattr(self, f"qweight{seg}")
        if q.device.type == "cuda" and self.use_kernel and \
                all(s in self.loaded for s, (i, _, _) in self.offsets.items() if i == seg):
            from flatserve.model import quant_planar

            if quant_planar.supported(fmt):  # the blocks are freed: one copy at the peak
                setattr(self, f"qweight{seg}", quant_planar.repack(q, fmt))
                self.planar.add(seg)

    def load_perm(self, shard: str, perm: torch.Tensor) -> None:
        """Every shard of a fused linear reads the same input, so it must share the order."""
        if self.perm.numel() and not torch.equal(self.perm, perm):
            raise ValueError(f"{shard}: its act-order permutation differs from its fused siblings'")
        self.perm = perm.long()

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        """A fused part's bias rows (Qwen2's q|k|v biases beside block-format weights), at the
        part's place in the output: the rows of the segments before its own, then its first row."""
        seg, row, n = self.offsets[shard]
        off = sum(m for i, _, m in self.offsets.values() if i < seg) + row
        dst = param.data.narrow(0, off, n)
        assert dst.shape == tensor.shape, f"{shard}: {tuple(tensor.shape)} != {tuple(dst.shape)}"
        dst.copy_(tensor)

    def missing(self) -> list[str]:
        return [s or "weight" for s in self.offsets if s not in self.loaded]

    def dequant_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as fp32 [len(ids), K] (single-segment tables: the embedding)."""
        assert len(self.fmts) == 1
        return dequantize(self.blocks(0, ids), self.fmts[0], self.in_features)

    def pack(self) -> torch.Tensor:
        """The linear as one uint8 tensor for the C++ decoder stack's `quant_linear` op: int64
        header words (segments, K, N, then per segment format, rows, row bytes, byte offset),
        then each segment's blocks 64-byte aligned. The segments' buffers become views of it, so
        the weights are not held twice; the Python path reads the same bytes."""
        if self.packed is not None:
            return self.packed
        assert not self.planar, "pack() is the CPU stack's; this linear holds the CUDA layout"
        segs = self.segments()
        words = [len(segs), self.in_features, self.out_features]
        off = -(-8 * (3 + 4 * len(segs)) // 64) * 64
        for fmt, q in segs:
            words += [fmt.ggml_type, q.shape[0], q.shape[1], off]
            off += -(-q.numel() // 64) * 64
        buf = torch.zeros(off, dtype=torch.uint8)
        buf[:8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
        for i, (_, q) in enumerate(segs):
            start = words[6 + 4 * i]
            view = buf[start:start + q.numel()].view(q.shape)
            view.copy_(q)
            setattr(self, f"qweight{i}", view)
        self.packed = buf
        return buf

    def weight_bytes(self) -> int:
        return sum(q.numel() for _, q in self.segments())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.perm.numel():
            x = x.index_select(-1, self.perm)
        if x.device.type == "cuda" and self.use_kernel and self._triton():
            from flatserve.model import quant_planar, quant_triton

            x2 = x.reshape(-1, self.in_features).contiguous()
            y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            col = 0
            for i, (fmt, q) in enumerate(self.segments()):
                mod = quant_planar if i in self.planar else quant_triton
                mod.qgemm(x2, q, fmt, y[:, col:col + q.shape[0]])
                col += q.shape[0]
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        ext = kernel() if self.use_kernel and x.device.type == "cpu" else None
        if ext is None:
            return self._bias(self.reference(x))
        x2 = x.reshape(-1, self.in_features)
        gen = _generated_rows(x2.shape[0])
        if gen is None:  # outside a step (tests, tools): by size, as a step of unknown rows
            gen = x2.shape[0] < PROMPT_ROWS
        if gen is True:
            y = self._int16(ext, x2)
        elif gen is False:
            y = self._prompt(ext, x2)
        else:  # a step mixing prompt chunks and generated tokens: each row on its own path
            y = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype)
            y[gen] = self._int16(ext, x2[gen])
            y[~gen] = self._prompt(ext, x2[~gen])
        return self._bias(y.reshape(*x.shape[:-1], self.out_features))

    def _bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def _int16(self, ext: Any, x2: torch.Tensor, path: int = AUTO) -> torch.Tensor:  # [T, K] -> [T, N]
        # int16 codes [T, K] (ACT_ORDER per block), scale and scaled sum per 32 values
        acts = ext.quantize_act(x2.contiguous())
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype)
        col = 0
        for fmt, q in self.segments():  # one unpacked weight row serves every activation row
            ext.gemm(*acts, q, fmt.ggml_type, y, col, path)
            col += q.shape[0]
        return y

    def _prompt(self, ext: Any, x2: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        """Prompt rows: the dense GEMM on dequantized weights (reference), or below AVX-512 the
        int16 codes (prompt_int16)."""
        if prompt_int16(ext):
            return self._int16(ext, x2)
        return self.reference(x2, ext)

    def _triton(self) -> bool:
        """Every segment in a format the Triton kernel reads (all of qformats.FORMATS but the
        ones only dequantized at load)."""
        from flatserve.model.quant_triton import KERNEL_FORMATS

        return all(f.name in KERNEL_FORMATS for f in self.fmts)

    def reference(self, x: torch.Tensor, ext: object | None = None) -> torch.Tensor:
        """Dequantize slices of rows (SLICE_BYTES of fp32 in torch; DENSE_BYTES with the C++
        kernel, the same bits) and run the dense matmul in x's dtype. With the C++ kernel a row's
        result does not depend on the call's other rows (_dense_rows says how)."""
        out_dtype = x.dtype
        if x.device.type == "cpu" and x.dtype != torch.float32 and not dev.cpu_has_fast_bf16():
            # No native bf16 (AVX2): torch emulates 16-bit matmuls. Gemma 3 270M's start-up (2,048-
            # token chunks) spent 0.37 s a call here in bf16, 0.06 s in fp32 (2-core EPYC, cProfile).
            x = x.float()
        amx_ext = _amx_ext(x, self.in_features) if ext is not None else None
        step = max(1, (DENSE_BYTES if ext is not None else SLICE_BYTES) // (4 * self.in_features))
        if amx_ext is not None:
            step = max(64, step // 64 * 64)  # AMX tiles take whole 64-row groups
        buf = None
        if ext is not None:
            buf = torch.empty(min(step, max(q.shape[0] for _, q in self.segments())), self.in_features,
                              dtype=x.dtype)
        col, y = 0, None
        for seg, fmt in enumerate(self.fmts):
            q = self.blocks(seg)
            for i in range(0, q.shape[0], step):
                if buf is not None:
                    w = buf[:min(step, q.shape[0] - i)]
                    ext.dequant(q[i:i + step], fmt.ggml_type, w)
                    part = _dense_rows(x, w, amx_ext)  # [M, n]: x is [M, K] here (forward's x2)
                else:
                    w = dequantize(q[i:i + step], fmt, self.in_features).to(x.dtype)
                    part = x @ w.t()
                if part.shape[-1] == self.out_features:  # one piece: it is the output
                    return part.to(out_dtype)
                if y is None:
                    y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
                y[..., col + i:col + i + part.shape[-1]] = part
            col += q.shape[0]
        return y.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, " + \
            "|".join(f"{f.name}:{q.shape[0]}" for f, q in self.segments())


def _amx_ext(x: torch.Tensor, k: int) -> Any:
    """The AMX bf16 GEMM kernel where this run's ISA level is amx and x is a bf16 CPU matrix."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2 or k % 32:
        return None
    from flatserve.model import amx

    return amx._ext() if amx.available(torch.bfloat16) else None


def _dense_rows(x: torch.Tensor, w: torch.Tensor, amx_ext: Any) -> torch.Tensor:
    """x [M, K] @ w [n, K]^T -> [M, n], each row's bits independent of M and of its place.

    Why: prefix caching and chunked prefill compute a prompt's rows in calls of any size, and a
    cached prompt must get the answer it got cold. torch's CPU matmul picks its kernel by M: on a
    2-core Xeon (AMX) bf16 rows differed at M = 8, 15, 22, ... against the same rows in a 300-row
    call, fp32 (MKL) at M = 12, 19, 26, ... with K = 2,048; a 2-core EPYC's MKL differed at M < 12
    only. Calls of one fixed shape were the same bits at every row offset (64, 128 and 256 rows,
    MKL as is and restricted to AVX2). So: AMX's own kernels where they run (each row's tile sums
    fixed; the packed and plain kernels give the same bits), else torch in ROW_TILE-row calls,
    the last one padded.
    Cost of the tiling on that Xeon (2,048 x 640 @ 640 x 2,048 fp32): +8-12% in 128-row calls,
    +22-31% in 64-row ones (benchmarks/dev/cpu_gemm_row_tiles.py, default and AVX2-only MKL).
    The AMX kernels: benchmarks/dev/cpu_amx_plain_vs_packed.py.
    """
    m = x.shape[0]
    if amx_ext is not None and w.shape[0] % 64 == 0:
        from flatserve.model import amx

        empty = amx._EMPTY
        # 2,048 prompt rows x 640 x 2,048 on that Xeon: packed 2.1 + 1.5 ms to pack, plain 5.7 ms;
        # at 256 rows 0.45 + 1.8 against 0.65 ms: pack for the larger calls only (1,024: between).
        if m >= 1024:
            return amx_ext.linear(x, amx._pack(w), empty, 0)
        return amx_ext.linear_plain(x, w, empty)
    if m % ROW_TILE:
        x = torch.cat([x, x.new_zeros(ROW_TILE - m % ROW_TILE, x.shape[1])])
    y = x.new_empty(x.shape[0], w.shape[0])
    for i in range(0, x.shape[0], ROW_TILE):
        torch.matmul(x[i:i + ROW_TILE], w.t(), out=y[i:i + ROW_TILE])
    return y[:m]


def _generated_rows(rows: int) -> bool | torch.Tensor | None:
    """Which of a step's rows take the int16-activation kernel: those of generated tokens (True),
    not those of prompt tokens (False), or a bool mask [rows] where a step holds both; None
    outside a step.

    Why per row: the quantized activations and the float GEMM round differently, and with the path
    chosen by the step's row count a token's logits depended on what else was batched with it
    (benchmarks/load_disconnects.py, default GGUF, 64 concurrent: 232 of 899 greedy answers
    differed from the same prompt served alone). Rows that are not one per token (the LM head's
    sampled rows) are each a sampling position: the kernel, whatever the step holds."""
    meta = metadata._scope.current
    if meta is None:
        return None
    cu = meta.cu_seqlens_q_host
    if rows != cu[-1]:
        return True
    if meta.prompt_lens_host is None:  # decode graphs: every token past its prompt
        return True
    mask = meta.derived.get("quant_generated_rows")
    if mask is None:  # once a step, vectorised (a prompt step holds up to thousands of rows)
        cu_np = np.asarray(cu)
        q = np.diff(cu_np)
        n_prompt = np.clip(np.asarray(meta.prompt_lens_host) - (np.asarray(meta.seq_lens_host) - q), 0, q)
        flags = np.arange(cu_np[-1]) >= np.repeat(cu_np[:-1] + n_prompt, q)  # past its prompt
        mask = bool(flags.all()) or (bool(flags.any()) and torch.from_numpy(flags))
        meta.derived["quant_generated_rows"] = mask
    return mask


class QuantEmbedding(nn.Module):
    """Row lookup that dequantizes a QuantLinear's rows (a tied LM head shares the table)."""

    def __init__(self, lin: QuantLinear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.lin, self.dtype = lin, dtype

    def load_quant(self, shard: str, raw: torch.Tensor, fmt: Format) -> None:
        self.lin.load_quant(shard, raw, fmt)

    def load_perm(self, shard: str, perm: torch.Tensor) -> None:
        self.lin.load_perm(shard, perm)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        rows = self.lin.dequant_rows(ids)
        return rows if self.dtype is None else rows.to(self.dtype)


def quantize_model(model: nn.Module, name: str) -> None:
    """`--quantization`: every nn.Linear (decoder projections, LM head) to QuantLinear in place;
    a tied embedding reads the head's table. int8 is q8_0. A tensor-parallel layer (one with
    `around`: flatserve/distributed/parallel.py) keeps its collective around the QuantLinear of
    its shard, its bias added after it."""
    fmt = FORMATS["q8_0" if name == "int8" else name]
    packed = sorted({type(m).__name__ for m in model.modules() if getattr(m, "cpu_packed", False)})
    if packed:  # their weights are out of reach (an opaque or tiled copy): they would stay dense
        raise ValueError(f"quantize_model: the model's linears are packed for the CPU GEMM "
                         f"({', '.join(packed)}); quantize before packing, as --quantization does at load")
    emb = model.model.embed_tokens
    tied = getattr(model.lm_head, "weight", None) is getattr(emb, "weight", 0)
    dtype = emb.weight.dtype
    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % fmt.block == 0:
                around = getattr(child, "around", None)
                inner_bias = child.bias is not None and around is None
                # On the weight's device: built on the host, load_quant moved a GPU model's blocks
                # there (since 6d784e3 the CUDA q4_0 run failed in its first forward).
                with torch.device(child.weight.device):
                    lin = QuantLinear(child.in_features, {"": (child.out_features, fmt)}, inner_bias)
                lin.load_quant("", quantize(child.weight.data, fmt), fmt)
                if inner_bias:
                    lin.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
                setattr(parent, cname, lin if around is None else around(lin))
    table = getattr(model.lm_head, "local", model.lm_head)
    if tied and isinstance(table, QuantLinear):
        around_table = getattr(emb, "around_table", None)
        model.model.embed_tokens = QuantEmbedding(table, dtype) if around_table is None else \
            around_table(table, dtype)


def swap_linears(model: nn.Module, formats: dict[str, Format], dtype: torch.dtype) -> None:
    """Before weights exist (meta): each linear whose every source tensor is stored in a block
    format (a GGUF's, or a GPTQ / AWQ checkpoint's converted to q4_g) becomes a QuantLinear of those formats, and a quantized embedding a QuantEmbedding
    (sharing the LM head's table where the two are tied). `formats`: HF weight name -> format."""
    from flatserve.model.layers import PackedLinear

    tied = model.cfg.tie_word_embeddings
    for parent_name, parent in list(model.named_modules()):
        for cname, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            base = f"{parent_name}.{cname}" if parent_name else cname
            if isinstance(child, PackedLinear):
                names = {s: f"{parent_name}.{s}.weight" for s in child.offsets}
                rows = {s: n for s, (_, n) in child.offsets.items()}
            else:
                src = "model.embed_tokens.weight" if base == "lm_head" and tied else f"{base}.weight"
                names, rows = {"": src}, {"": child.out_features}
            if all(n in formats for n in names.values()):
                shards = {s: (rows[s], formats[n]) for s, n in names.items()}
                setattr(parent, cname, QuantLinear(child.in_features, shards, child.bias is not None))
    emb = model.model.embed_tokens
    fmt = formats.get("model.embed_tokens.weight")
    if fmt is not None:
        lin = model.lm_head if tied and isinstance(model.lm_head, QuantLinear) else \
            QuantLinear(emb.embedding_dim, {"": (emb.num_embeddings, fmt)})
        model.model.embed_tokens = QuantEmbedding(lin, dtype)


def summary(model: nn.Module) -> dict[str, tuple[int, int]]:
    """format -> (linear segments, bytes) over the QuantLinears, a shared table counted once;
    "dense" -> (other linears, their weights' bytes)."""
    out: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    for m in model.modules():
        pairs = m.segments() if isinstance(m, QuantLinear) else \
            [("dense", m.weight)] if isinstance(m, nn.Linear) else []
        for fmt, t in pairs:
            name = fmt if isinstance(fmt, str) else fmt.name
            new = t.data_ptr() not in seen
            seen.add(t.data_ptr())
            n, b = out.get(name, (0, 0))
            out[name] = (n + 1, b + (t.numel() * t.element_size() if new else 0))
    return out


def describe(formats: dict[str, tuple[int, int]]) -> str:
    """'q4_k x 27 (9.7 MiB), q5_0 x 36 (...)': the start-up line's weight formats."""
    return ", ".join(f"{k} x {n} ({b / 2**20:.1f} MiB)" for k, (n, b) in sorted(formats.items()))
