"""4-bit GPTQ and AWQ safetensors checkpoints (the layouts transformers / AutoGPTQ / AutoAWQ write
and vLLM serves) -> QuantLinears in our q4_g blocks (model/qformats.py), at load.

Per linear [N out, K in], groups of `group_size` (32-128) input values share an fp16 scale and a
4-bit zero point per output row:

  GPTQ: qweight int32 [K/8, N] (value k = 8i + j in bits 4j of row i), qzeros int32 [G, N/8]
        (column 8i + j in bits 4j; the "gptq" checkpoint format stores zero - 1), scales fp16
        [G, N], g_idx int32 [K] (k's group; with act-order (desc_act) not k // group_size).
  AWQ:  qweight int32 [K, N/8], qzeros int32 [G, N/8], both packed along N in the order
        0 2 4 6 1 3 5 7 (nibble i holds column 8c + order[i]); scales fp16 [G, N]; group k // g.

  w[n, k] = scale[g(k), n] * (q[k, n] - zero[g(k), n])                      (`reference`)

q4_g blocks hold 32 values with one scale and zero each, so a group of 32-128 is 1-4 blocks.
Act-order groups are not contiguous in k: the input dimension is permuted so that they are
(`perm`, applied to activations in QuantLinear.forward), as exllama does.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from flatserve.model.qformats import pack_g

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def config(hf: Any) -> dict[str, Any] | None:
    """The checkpoint's 4-bit GPTQ / AWQ settings; None for any other checkpoint (float, or a
    method another loader handles: GPT-OSS's mxfp4 experts, model/moe.py). A GPTQ / AWQ layout
    we cannot serve is refused with the reason."""
    qc = getattr(hf, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        return None
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits != 4 or not isinstance(group, int) or group % 32 or not 32 <= group <= 1024:
        raise ValueError(f"{method}: need 4 bits and a group size that is a multiple of 32, got bits "
                         f"{bits}, group_size {group}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"awq version {qc.get('version')!r}: only the GEMM layout is supported")
    if method == "awq" and qc.get("zero_point") is False:
        raise ValueError("awq without zero points is not supported")
    if method == "gptq" and qc.get("sym") is False and str(qc.get("checkpoint_format", "gptq")) == "gptq":
        pass  # asymmetric v1 files store zero - 1 like symmetric ones
    return {"method": method, "group": group,
            "v1": method == "gptq" and str(qc.get("checkpoint_format", "gptq")) == "gptq"}


def _nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensor -> its 8 nibbles (bits 4j at position j) spread along `dim` (x8), uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    n = (x.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    n = n.movedim(-1, dim + 1) if dim >= 0 else n
    shape = list(x.shape)
    shape[dim] *= 8
    return n.reshape(shape).to(torch.uint8)


def unpack(parts: dict[str, torch.Tensor], qc: dict[str, Any]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> codes uint8 [N, K], zeros uint8 [G, N], scales fp16 [G, N], g_idx int64 [K]."""
    scales = parts["scales"].to(torch.float16)
    if qc["method"] == "gptq":
        q = _nibbles(parts["qweight"], 0).t()  # [K, N] -> [N, K]
        z = _nibbles(parts["qzeros"], 1)  # [G, N]
        if qc["v1"]:
            z = z + 1  # zero - 1 stored (reaches 16: q4_g's int8 codes hold q - 16)
        k = q.shape[1]
        g = parts.get("g_idx")
        g_idx = g.long() if g is not None else torch.arange(k) // qc["group"]
    else:
        inv = torch.tensor(AWQ_ORDER).argsort()  # nibble holding column j of each 8
        q = _nibbles(parts["qweight"], 1).reshape(parts["qweight"].shape[0], -1, 8)[:, :, inv]
        q = q.reshape(q.shape[0], -1).t()  # [N, K]
        z = _nibbles(parts["qzeros"], 1).reshape(parts["qzeros"].shape[0], -1, 8)[:, :, inv]
        z = z.reshape(z.shape[0], -1)
        g_idx = torch.arange(q.shape[1]) // qc["group"]
    return q.contiguous(), z, scales, g_idx


def reference(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The torch reference: fp32 [N, K] = scale * (q - zero) per element's group."""
    return s[g_idx].t().float() * (q.to(torch.int16) - z[g_idx].t().to(torch.int16)).float()


def to_blocks(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> q4_g rows uint8 [N, K/32 * 19] and the input permutation (None when groups are runs
    of k already). Dequantized, the rows are `reference` with its columns permuted: bit-equal."""
    n, k = q.shape
    perm = torch.argsort(g_idx, stable=True)
    if torch.equal(perm, torch.arange(k)):
        perm = None
    else:
        q, g_idx = q[:, perm], g_idx[perm]
    gb = g_idx.reshape(-1, 32)
    if not (gb == gb[:, :1]).all():
        raise ValueError("a group's size is not a multiple of 32 values")
    gb = gb[:, 0]  # [K/32] each block's group
    d = s[gb].t().float().reshape(-1)  # [N * K/32]
    zz = z[gb].t().reshape(-1)
    return pack_g(d, zz, q.reshape(-1, 32)).reshape(n, -1), perm


def convert(weights: Iterator[tuple[str, torch.Tensor]], qc: dict[str, Any]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors -> the same with each quantized linear's parts replaced by `W.weight#q4_g`
    (and `W.weight#perm` under act-order), which load_weights routes to its QuantLinear."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, part = name.rpartition(".")
        if part in _PARTS:
            held.setdefault(prefix, {})[part] = t
        else:
            yield name, t
    for prefix, parts in held.items():  # every shard read: a linear's parts may span files
        missing = [p for p in _PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{prefix}: {qc['method']} tensors missing: {missing}")
        raw, perm = to_blocks(*unpack(parts, qc))
        yield f"{prefix}.weight#q4_g", raw
        if perm is not None:
            yield f"{prefix}.weight#perm", perm


def formats(names: list[str]) -> dict[str, str]:
    """Checkpoint tensor names -> {HF weight name: 'q4_g'} for every linear stored quantized."""
    return {n[: -len(".qweight")] + ".weight": "q4_g" for n in names if n.endswith(".qweight")}
