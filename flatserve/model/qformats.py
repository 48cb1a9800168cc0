"""GGUF block formats kept as their stored bytes: layouts, the torch dequantization (the reference
every kernel is checked against, bit-equal to the `gguf` package's numpy `dequantize`) and
quantizers for `--quantization` and the tests.

A quantized [N, K] matrix is a uint8 tensor [N, (K / block) * type_size]: each row is its K / block
blocks in order, exactly as llama.cpp stores a GGUF tensor. Block layouts (ggml-common.h):

  Q4_0 (32 values, 18 B): d f16 | qs[16]             x = d * (q - 8),  q: low nibbles are values 0-15, high 16-31
  Q5_0 (32, 22 B):        d f16 | qh u32 | qs[16]    x = d * (q - 16), bit 4 of value j is bit j of qh
  Q8_0 (32, 34 B):        d f16 | qs int8[32]         x = d * q
  Q4_K (256, 144 B):      d f16 | dmin f16 | scales[12] (8 x 6-bit scale + 8 x 6-bit min) | qs[128]
                          x = d * sc[j] * q - dmin * m[j] for sub-block j of 32; each 32 bytes of qs
                          hold sub-block 2i in the low nibbles and 2i+1 in the high ones
  Q5_K (256, 176 B):      d | dmin | scales[12] | qh[32] | qs[128]; bit 4 of value l of sub-block j
                          is bit j of qh[l]
  Q6_K (256, 210 B):      ql[128] | qh[64] | scales int8[16] | d f16;  x = d * sc[i] * (q - 32), 16 per i

and one of our own, for 4-bit GPTQ / AWQ checkpoints (model/gptq.py; no GGUF type has a zero point
per 32 values with an fp16 scale):

  Q4_G (32 values, 19 B): d f16 | z u8 | qs[16]      x = d * (q - z), nibbles as Q4_0
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    ggml_type: int  # GGMLQuantizationType value (the kernel's format code too)
    block: int  # values per block
    type_size: int  # bytes per block

    def row_bytes(self, k: int) -> int:
        if k % self.block:
            raise ValueError(f"{self.name} needs rows that are a multiple of {self.block} values, got {k}")
        return k // self.block * self.type_size


FORMATS = {f.name: f for f in (
    Format("q4_0", 2, 32, 18), Format("q5_0", 6, 32, 22), Format("q8_0", 8, 32, 34),
    Format("q4_k", 12, 256, 144), Format("q5_k", 13, 256, 176), Format("q6_k", 14, 256, 210),
    Format("q4_g", 100, 32, 19))}
GGUF = frozenset({"q4_0", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k"})
BY_GGML = {f.ggml_type: f for f in FORMATS.values() if f.name in GGUF}


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:  # [nb, >=off+2] uint8 -> [nb, 1] fp32
    return b[:, off:off + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return qs & 0x0F, qs >> 4


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, 12] uint8 -> 6-bit scales, mins [nb, 8] each (Q4_K/Q5_K's packing)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], 1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], 1)
    return sc, mn


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """[nb, n/8] uint8 little-endian bit strings -> [nb, n] uint8 of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[:, :, None] >> shifts) & 1).reshape(b.shape[0], n)


def _deq_blocks(b: torch.Tensor, fmt: Format) -> torch.Tensor:  # [nb, type_size] -> [nb, block] fp32
    nb = b.shape[0]
    if fmt.name == "q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)
    if fmt.name == "q4_g":
        lo, hi = _nibbles(b[:, 3:19])
        q = torch.cat([lo, hi], 1).to(torch.int16) - b[:, 2:3].to(torch.int16)  # [nb, 32]
        return _f16(b, 0) * q.float()
    if fmt.name in ("q4_0", "q5_0"):
        lo, hi = _nibbles(b[:, -16:])
        q = torch.cat([lo, hi], 1)  # [nb, 32]
        if fmt.name == "q5_0":
            q = q | (_bits(b[:, 2:6], 32) << 4)
        off = 8 if fmt.name == "q4_0" else 16
        return _f16(b, 0) * (q.to(torch.int8) - off).float()
    if fmt.name in ("q4_k", "q5_k"):
        sc, mn = _k_scales(b[:, 4:16])
        d = (_f16(b, 0) * sc.float())[:, :, None]  # [nb, 8, 1]
        dm = (_f16(b, 2) * mn.float())[:, :, None]
        lo, hi = _nibbles(b[:, -128:].reshape(nb, 4, 32))
        q = torch.stack([lo, hi], 2).reshape(nb, 8, 32)
        if fmt.name == "q5_k":  # bit j of qh[l] is bit 4 of value l of sub-block j
            q = q | ((_bits(b[:, 16:48], 256).reshape(nb, 32, 8).transpose(1, 2)) << 4)
        return (d * q.float() - dm).reshape(nb, 256)
    if fmt.name == "q6_k":
        ql, qh = b[:, 0:128].reshape(nb, 2, 1, 64), b[:, 128:192].reshape(nb, 2, 1, 32)
        # Shift amounts from arange, not torch.tensor(list): no host-to-device copy, so a CUDA
        # graph can capture this (a quantized embedding dequantizes rows inside the decode step).
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device)
        lo = ((ql >> (2 * shifts[:2]).reshape(1, 1, 2, 1)) & 0x0F).reshape(nb, 2, 4, 32)
        hi = (qh >> shifts.reshape(1, 1, 4, 1)) & 0x03  # [nb, 2, 4, 32]
        q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(nb, 16, 16).float()
        d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float())[:, :, None]
        return (d * q).reshape(nb, 256)
    raise ValueError(f"no dequantization for {fmt.name}")


def dequantize(raw: torch.Tensor, fmt: Format, k: int) -> torch.Tensor:
    """raw uint8 [N, row_bytes] -> fp32 [N, K], per block as llama.cpp defines it."""
    n = raw.shape[0]
    blocks = raw.reshape(n * (k // fmt.block), fmt.type_size)
    return _deq_blocks(blocks, fmt).reshape(n, k)


# --- quantizers ----------------------------------------------------------------------------------

def quantize(w: torch.Tensor, fmt: Format, chunk: int = 4096) -> torch.Tensor:
    """float [N, K] -> uint8 [N, row_bytes]. q4_0 / q5_0 / q8_0 through the `gguf` package (the
    reference quantizers' bits); the K formats through a plain min/max fit (llama.cpp searches
    scales more carefully; these serve `--quantization` tests and random-weight checks)."""
    n, k = w.shape
    out = torch.empty(n, fmt.row_bytes(k), dtype=torch.uint8, device=w.device)
    for i in range(0, n, chunk):  # an fp32 copy of a 262k-row head at once would be 671 MB
        if fmt.name in ("q4_0", "q8_0"):  # on w's device (a GPU quantizes 8B weights in ~1 s)
            out[i:i + chunk] = _quantize_32(w[i:i + chunk].float().reshape(-1, 32), fmt).reshape(
                min(chunk, n - i), -1)
            continue
        wf = w[i:i + chunk].float().cpu()
        if fmt.name == "q4_g":
            out[i:i + chunk] = _quantize_g(wf.reshape(-1, 32)).reshape(wf.shape[0], -1)
        elif fmt.name in ("q4_0", "q5_0", "q8_0"):
            import gguf

            q = gguf.quants.quantize(wf.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
            out[i:i + chunk] = torch.from_numpy(q.reshape(wf.shape[0], -1))
        else:
            out[i:i + chunk] = _quantize_k(wf.reshape(-1, 256), fmt).reshape(wf.shape[0], -1)
    return out


def _quantize_32(b: torch.Tensor, fmt: Format) -> torch.Tensor:
    """[nb, 32] fp32 -> q4_0 / q8_0 blocks with the `gguf` package's bits (its numpy code, op for
    op in fp32: no fused multiply-add; tests/model/test_qformats.py compares them), in torch so a
    GPU's weights quantize where they are (numpy took ~100 s for Llama-3-8B on one core)."""
    if fmt.name == "q4_0":
        mx = b.gather(1, b.abs().argmax(1, keepdim=True))  # signed value of largest magnitude
        d = mx / -8
    else:
        d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    y = b * inv
    if fmt.name == "q4_0":
        q = torch.trunc(y + 8.5).clamp(0, 15).to(torch.uint8)
        q = q[:, :16] | (q[:, 16:] << 4)
    else:  # gguf's np_roundf: half away from zero
        a = y.abs()
        fl = torch.floor(a)
        q = (torch.sign(y) * (fl + torch.floor(2 * (a - fl)))).to(torch.int8).view(torch.uint8)
    return torch.cat([d.to(torch.float16).view(torch.uint8), q], 1)


def _quantize_g(x: torch.Tensor) -> torch.Tensor:
    """[nb, 32] fp32 -> q4_g blocks: asymmetric min/max, x ~ d * (q - z)."""
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    d = ((hi - lo) / 15).to(torch.float16).float()
    z = torch.where(d > 0, torch.round(-lo / d.clamp(min=1e-30)), 0).clamp(0, 15)
    q = torch.where(d[:, None] > 0, torch.round(x / d.clamp(min=1e-30)[:, None]) + z[:, None], 0).clamp(0, 15)
    q = q.to(torch.uint8)
    return pack_g(d, z.to(torch.uint8), q)


def pack_g(d: torch.Tensor, z: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """scales [nb] (fp16-exact), zeros uint8 [nb], codes uint8 [nb, 32] -> q4_g blocks [nb, 19]."""
    return torch.cat([_fp16_bytes(d), z.reshape(-1, 1), q[:, :16] | (q[:, 16:] << 4)], 1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:  # [nb] fp32 -> [nb, 2] uint8
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _quantize_k(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """[nb, 256] fp32 -> [nb, type_size] uint8 for q4_k, q5_k, q6_k."""
    nb = x.shape[0]
    if fmt.name == "q6_k":
        sub = x.reshape(nb, 16, 16)
        s = sub.abs().amax(2) / 31.5  # [nb, 16]
        d = (s.amax(1) / 127).to(torch.float16).float()  # [nb]
        sc = torch.where(d[:, None] > 0, torch.round(s / d.clamp(min=1e-30)[:, None]), 0).clamp(-128, 127)
        step = (d[:, None] * sc)[:, :, None]
        q = torch.where(step > 0, torch.round(sub / step.clamp(min=1e-30)), 0).clamp(-32, 31) + 32
        q = q.to(torch.uint8).reshape(nb, 2, 4, 32)  # (half, quarter, l)
        ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [nb, 2, 2, 32]
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        return torch.cat([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.to(torch.int8).view(torch.uint8),
                          _fp16_bytes(d)], 1)
    top = 15 if fmt.name == "q4_k" else 31
    sub = x.reshape(nb, 8, 32)
    lo = sub.amin(2).clamp(max=0)  # [nb, 8]: the min is stored as a positive offset
    scale = (sub.amax(2) - lo) / top
    d = (scale.amax(1) / 63).to(torch.float16).float()
    dmin = ((-lo).amax(1) / 63).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, torch.round(scale / d.clamp(min=1e-30)[:, None]), 0).clamp(0, 63)
    mn = torch.where(dmin[:, None] > 0, torch.round(-lo / dmin.clamp(min=1e-30)[:, None]), 0).clamp(0, 63)
    step = (d[:, None] * sc)[:, :, None]
    q = torch.where(step > 0, torch.round((sub + (dmin[:, None] * mn)[:, :, None]) / step.clamp(min=1e-30)), 0)
    q = q.clamp(0, top).to(torch.uint8)  # [nb, 8, 32]
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    scales = torch.cat([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], 1)
    qs = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(nb, 128)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), scales]
    if fmt.name == "q5_k":  # qh[l] bit j = bit 4 of value l of sub-block j
        hb = (q >> 4).transpose(1, 2).to(torch.int32)  # [nb, 32, 8]
        parts.append((hb << torch.arange(8, dtype=torch.int32)).sum(2).to(torch.uint8))
    return torch.cat(parts + [qs], 1)
