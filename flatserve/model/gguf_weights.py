"""GGUF tensors -> HF-named float32 tensors, dequantized with the `gguf` package."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

# llama.cpp tensor names -> HF names, per GGUF `general.architecture`.
_COMMON = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "qwen3": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"^(\w+)\.(weight|bias)$")


def _architecture(reader: object) -> str:
    field = reader.fields["general.architecture"]  # type: ignore[attr-defined]
    return bytes(field.parts[field.data[0]]).decode()


def _hf_name(arch: str, name: str) -> str | None:
    table = {**_COMMON, **_BLOCK_NAMES[arch]}
    if m := _BLK.match(name):
        hf = table.get(m.group(2))
        return None if hf is None else f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    if m := _TOP.match(name):
        hf = table.get(m.group(1))
        return None if hf is None else f"{hf}.{m.group(2)}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves q/k rows for its rope kernel on Llama; undo it for rotate-half.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: Path, n_head: int, n_kv_head: int) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))  # ~12 s on 2 cores for a 262k-token vocab
    arch = _architecture(reader)
    if arch not in _BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_BLOCK_NAMES)}")
    for t in reader.tensors:
        hf = _hf_name(arch, t.name)
        if hf is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, n_head if "q_proj" in hf else n_kv_head)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms pre-shifted
        yield hf, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
