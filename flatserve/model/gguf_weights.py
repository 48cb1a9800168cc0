"""GGUF tensors -> HF-named tensors: float32 (dequantized with the `gguf` package), or, for the
block formats the quantized linears read in place (model/qformats.py), the stored bytes."""
from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
_LLAMA = {"ffn_norm": "post_attention_layernorm"}
_GEMMA = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_BLOCK_NAMES = {
    # MoE: the router, and the experts' [E, rows, cols] stacks under names the MoE block maps
    # (model/moe.py, `load_hf_tensor`); GPT-OSS's gate and up arrive already de-interleaved.
    "qwen3moe": {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
                 "ffn_gate_exps": "mlp.experts.gate_exps", "ffn_up_exps": "mlp.experts.up_exps",
                 "ffn_down_exps": "mlp.experts.down_exps"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_exps",
                "ffn_up_exps": "mlp.experts.up_exps", "ffn_down_exps": "mlp.experts.down_exps"},
    "llama": _LLAMA, "qwen3": _LLAMA, "qwen2": _LLAMA, "smollm3": _LLAMA, "granite": _LLAMA,
    # Phi-3: q|k|v in one tensor, and ffn_up holds gate|up (the checkpoint's own packing)
    "phi3": {**_LLAMA, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma3": _GEMMA, "gemma2": _GEMMA,
}
# llama.cpp's converter permutes q/k rows (LlamaModel and its subclasses) for these.
_PERMUTED = ("llama", "smollm3", "granite")
# ... and stores Gemma's (1 + w) norm weights pre-shifted for these.
_SHIFTED_NORMS = ("gemma3", "gemma2")
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


def iter_gguf_weights(path: Path, n_head: int, n_kv_head: int, keep_quantized: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor, str | None]]:
    """-> (HF name, tensor, format name or None). With `keep_quantized`, tensors in a kernel
    format come as their bytes (uint8 [rows, row_bytes]) and every other quantized type is
    dequantized, named once in a log line."""
    import gguf

    from flatserve.model.qformats import BY_GGML

    reader = gguf.GGUFReader(str(path))  # ~12 s on 2 cores for a 262k-token vocab
    arch = _architecture(reader)
    if arch not in _BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_BLOCK_NAMES)}")
    reader.fields.clear()  # the metadata's objects (0.67 GiB for a 262k-token vocab): not needed here
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    others: dict[str, int] = {}
    for t in reader.tensors:
        hf = _hf_name(arch, t.name)
        if hf is None:
            continue  # e.g. rope_freqs, rope_factors_*: read into the config
        if ".experts." in hf or hf.endswith("sinks.weight"):  # stacks and sinks: no ".weight"
            hf = hf.replace(".weight", "").replace(".bias", "_bias")
        shape = tuple(reversed([int(x) for x in t.shape]))
        fmt = BY_GGML.get(int(t.tensor_type)) if keep_quantized and len(shape) == 2 else None
        if fmt is not None:
            w = np.asarray(t.data).reshape(shape[0], -1)  # [rows, row_bytes] blocks
        else:
            if keep_quantized and t.tensor_type not in plain:
                others[t.tensor_type.name] = others.get(t.tensor_type.name, 0) + 1
            w = _dequantize_rows(t.data, t.tensor_type, shape)
        if arch in _PERMUTED and hf.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, n_head if "q_proj" in hf else n_kv_head)  # whole rows: blocks too
        if arch in _SHIFTED_NORMS and hf.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms pre-shifted
        dtype = np.uint8 if fmt is not None else np.float32
        if fmt is not None or not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, dtype=dtype, order="C")  # own copy: the file's map is read-only
        yield hf, torch.from_numpy(w), None if fmt is None else fmt.name
    if others:
        logging.getLogger("flatserve").warning(
            "GGUF types without an in-place kernel, dequantized at load: %s",
            ", ".join(f"{k} ({v} tensors)" for k, v in sorted(others.items())))




def _dequantize_rows(data: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """gguf's dequantize, 4,096 rows at a time into one fp32 array: whole, its numpy temporaries
    for the 262k-row embedding took the load's peak RSS to 2.9 GiB (1.5 GiB after)."""
    from gguf.quants import dequantize

    out = np.empty(shape, dtype=np.float32)
    if data.ndim < 2 or data.shape[0] != shape[0]:
        out[...] = dequantize(data, qtype).reshape(shape)
        return out
    flat = out.reshape(shape[0], -1)
    for i in range(0, shape[0], 4096):
        flat[i:i + 4096] = dequantize(data[i:i + 4096], qtype).reshape(-1, flat.shape[1])
    return out


def moe_hf_config(path: Path) -> object | None:
    """The HF config of a `qwen3moe` or `gpt-oss` GGUF, read from its metadata here (None for
    other architectures): transformers' GGUF reader leaves the expert width and Qwen3-MoE's
    renormalized top-k (llama.cpp's qwen3moe graph always renormalizes) at its defaults, and
    fails on GPT-OSS's rope-scaling keys (5.24: `float()` of a field's name part)."""
    import gguf

    if _first_key_architecture(path) not in (None, "qwen3moe", "gpt-oss"):
        return None  # the others skip the full metadata read (~12 s for a 262k-token vocab)
    reader = gguf.GGUFReader(str(path))
    arch = _architecture(reader)
    if arch not in ("qwen3moe", "gpt-oss"):
        return None

    def get(key: str, default: object = None) -> object:
        f = reader.fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()
    tok = reader.fields.get("tokenizer.ggml.tokens")
    common = dict(
        vocab_size=get("vocab_size") or (len(tok.data) if tok is not None else None),
        hidden_size=get("embedding_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count_kv"), head_dim=get("attention.key_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=get("context_length"), num_experts_per_tok=get("expert_used_count"),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"))
    if arch == "qwen3moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, intermediate_size=get("feed_forward_length"),
                              moe_intermediate_size=get("expert_feed_forward_length"),
                              num_experts=get("expert_count"), norm_topk_prob=True,
                              rope_parameters={"rope_type": "default",
                                               "rope_theta": get("rope.freq_base", 1e6)},
                              architectures=["Qwen3MoeForCausalLM"])
    from transformers import GptOssConfig

    rope: dict[str, object] = {"rope_type": "default", "rope_theta": get("rope.freq_base", 150000.0)}
    if get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=get("rope.scaling.factor"), beta_fast=32.0,
                    beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=get("rope.scaling.original_context_length"))
    return GptOssConfig(**common, intermediate_size=get("expert_feed_forward_length"),
                        num_local_experts=get("expert_count"),
                        sliding_window=get("attention.sliding_window"), rope_parameters=rope,
                        architectures=["GptOssForCausalLM"])


def _first_key_architecture(path: Path) -> str | None:
    """general.architecture where it is the header's first key (llama.cpp writes it first), else None."""
    import struct

    with open(path, "rb") as f:
        head = f.read(24 + 8 + 64)
    if len(head) < 32 or head[:4] != b"GGUF":
        return None
    (klen,) = struct.unpack_from("<Q", head, 24)
    if head[32:32 + klen] != b"general.architecture" or len(head) < 32 + klen + 12:
        return None
    (vlen,) = struct.unpack_from("<Q", head, 32 + klen + 4)
    with open(path, "rb") as f:
        f.seek(32 + klen + 12)
        return f.read(vlen).decode(errors="replace")


def _field(reader: object, key: str) -> object:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    return None if f is None else f.contents()
