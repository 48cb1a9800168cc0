"""One frozen EngineConfig built once from CLI/kwargs and passed down.

Numbers found at start-up (block count, eos ids, chosen backend and dtype) are *not* written
back here: they live in `flatserve.engine.engine.EngineState` / `flatserve.memory.CacheBudget`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None -> the embedded default
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | mps
    attention_backend: str | None = None  # None: follows the device (torch on cpu/mps)
    block_size: int = 16
    # None: sized by the device at start-up (flatserve/engine/limits.py: 64 / 2,048 on CPUs, up
    # to 512 / 32,768 on an 80 GB GPU); EngineState.config holds the values in force.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # Memory budget (see flatserve/memory.py).
    kv_cache_memory: int | None = None  # bytes; overrides the computed budget
    num_gpu_blocks_override: int | None = None  # exact block count (tests)
    os_reserve_gb: float | None = None  # unified memory: RAM kept for the OS and other apps
    gpu_memory_utilization: float = 0.9  # discrete GPU: fraction of device memory to claim
    enforce_eager: bool = False  # no CUDA graphs and no CPU decoder stack (model/cpu_stack.py)
    async_scheduling: bool | None = None  # None: on for CUDA without speculation
    fused_ops: str = "auto"  # auto | none | comma list of rmsnorm,rope,act (flatserve/ops)
    # Float checkpoints: None | q8_0 | q4_0 | int8 (= q8_0): weights kept in that GGUF block format
    # (flatserve/model/quant.py). GGUF files keep their stored formats unless `dequantize`.
    quantization: str | None = None
    dequantize: bool = False  # GGUF: dequantize every tensor to `dtype` at load (the dense path)
    # auto: the checkpoint's weights | dummy: random weights from config.json alone (vLLM's name),
    # for speed runs at real sizes without writing the files (a 30B MoE is 61 GB in bf16).
    load_format: str = "auto"
    # CPU bf16 linears: auto | amx (our AMX kernel, flatserve/model/amx.py) | onednn (pre-packed
    # weights, flatserve/model/onednn.py) | torch. auto: amx, else onednn, else torch.
    cpu_gemm: str = "auto"
    # amx: a tied LM head is read in place from the embedding table; True packs a copy instead
    # (+335 MB for the default model; decode steps at 16 requests ~5% faster on the dev box).
    copy_tied_lm_head: bool = False
    # amx, avx2: greedy rows take their argmax from a one-byte (7-bit) copy of the LM head with exact
    # bounds, rescoring the few rows that can win in bf16 (flatserve/model/greedy_head.py): the
    # same tokens, half the head's bytes, +171 MB for the default model. None (auto): only where
    # the linears are the AVX2 kernel (no native bf16: there one stream needs it, 0.73x llama-server
    # with it, ~0.5x estimated without from the bf16 head's 1.4x time), not on AMX (one stream
    # 1.32x with it, 0.98x without, and the copy took bf16 peak RSS at 16 streams over 1.2 GiB:
    # docs/performance-cpu.md).
    greedy_int8_head: bool | None = None
    served_model_name: str | None = None
    chat_template: str | None = None  # path to a Jinja template overriding the model's
    # Speculative decoding: None | "ngram" (prompt lookup) | "draft" (speculative_model).
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    speculative_model: str | None = None
    prompt_lookup_min: int = 2  # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    # More than one device (flatserve/distributed): Megatron tensor parallelism over ranks the
    # engine spawns; data-parallel replicas behind one server; torchrun-style multi-host.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one host)
    dist_timeout_s: float = 300.0  # every rank must join the rendezvous within this

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be ngram or draft, got {self.speculative_method!r}")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method 'draft' needs speculative_model (a smaller model "
                             "with the same tokenizer)")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.quantization not in (None, "int8", "q8_0", "q4_0"):
            raise ValueError(f"quantization must be q8_0, q4_0 or int8 (= q8_0), or unset; got "
                             f"{self.quantization!r}")
        if self.quantization and self.dequantize:
            raise ValueError("quantization and dequantize exclude each other")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.cpu_gemm not in ("auto", "amx", "onednn", "avx2", "torch"):
            raise ValueError(f"cpu_gemm must be auto, amx, onednn, avx2 or torch, got {self.cpu_gemm!r}")
        self._validate_parallel()
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


    def _validate_parallel(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size} and {self.data_parallel_size}")
        if self.tensor_parallel_size == 1 and self.nnodes == 1:
            return
        what = f"tensor parallelism (tensor_parallel_size {self.tensor_parallel_size})"
        if self.speculative_method:
            raise ValueError(f"speculative decoding is not supported with {what} yet")
        if self.async_scheduling:
            raise ValueError(f"async_scheduling is not supported with {what} yet")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs on one node; multi-node runs one replica")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {self.dist_timeout_s}")

    @property
    def distributed(self) -> bool:
        """Tensor-parallel ranks (flatserve/distributed) rather than the single-device engine."""
        return self.tensor_parallel_size > 1 or self.nnodes > 1


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, '1000' -> 1000 bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (examples: 4GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])
