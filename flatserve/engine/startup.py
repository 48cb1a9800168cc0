"""Start-up: device, model, tokenizer, measured peak, memory budget, KV pool.

What it finds goes into `EngineState`, never back into the frozen EngineConfig.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flatserve import device as dev
from flatserve import kernels
from flatserve import ops
from flatserve.config import EngineConfig
from flatserve.engine.limits import size_limits
from flatserve.engine.request import Request
from flatserve.engine.sampler import Sampler
from flatserve.engine.sampling_params import SamplingParams
from flatserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from flatserve.memory import BudgetError, BudgetRequest, CacheBudget, plan
from flatserve.model.config import ModelConfig
from flatserve.model.layers import share_rope_tables
from flatserve.model.loader import ModelSource, build_model, load_hf_config, resolve_model
from flatserve.model.registry import get_model_class
from flatserve.runner import ModelRunner

if TYPE_CHECKING:
    from flatserve.distributed.group import TPGroup

log = logging.getLogger("flatserve")


@dataclass(frozen=True, slots=True)
class EngineState:
    model: ModelConfig
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    backend: str
    budget: CacheBudget
    eos_token_ids: frozenset[int]
    weights_bytes: int
    fused_ops: frozenset[str] = frozenset()  # flatserve/ops kernels swapped in
    cpu_gemm: str = "torch"  # how linears run: amx | onednn (pre-packed, CPU bf16) | torch
    config: EngineConfig | None = None  # the config in force: step limits sized by the device
    # Linears by weight format: format -> (segments, bytes); "dense" for unquantized linears.
    weight_formats: tuple[tuple[str, int, int], ...] = ()

    @property
    def max_model_len(self) -> int:
        return self.budget.max_model_len


def load_tokenizer(src: ModelSource, override: str | None) -> Any:
    from transformers import AutoTokenizer

    kwargs = {"pretrained_model_name_or_path": override} if override else src.hf_kwargs
    try:
        tok = AutoTokenizer.from_pretrained(**kwargs)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {str(src.path)!r}: {e}") from None
    # transformers 5's model classes (GemmaTokenizer, LlamaTokenizer, ...) keep the Python vocab
    # dict and merges list they built the Rust tokenizer from; only their __init__ (and a few
    # save_vocabulary methods, never called here) read them. The default model's 262k vocab and
    # 515k merges held 135 MB of RSS that way (2-core AMD EPYC, 2026-11-26).
    for attr in ("_vocab", "_merges"):
        tok.__dict__.pop(attr, None)
    # And init_kwargs keeps a deep copy of every added token for save_pretrained (never called on
    # this object; the added tokens live in the Rust tokenizer, added_tokens_decoder reads them
    # there): the default model's 6,384 held 39 MB of RSS (2-core Zen 4, 2026-11-29).
    init = getattr(tok, "init_kwargs", None)
    if isinstance(init, dict):
        init.pop("added_tokens_decoder", None)
    return tok


def _eos_ids(mcfg: ModelConfig, tokenizer: Any, src: ModelSource) -> frozenset[int]:
    ids = set(mcfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not src.is_gguf:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(str(src.path)).eos_token_id
            ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        except OSError:
            pass  # no generation_config.json
    return frozenset(ids)


def _full_step(mcfg: ModelConfig, cfg: EngineConfig, seqs: int, k: int,
               params: SamplingParams) -> tuple[SchedulerOutput, int]:
    """A step of max_num_batched_tokens prompt tokens over `seqs` sequences, each verifying k
    drafts; -> the step and the KV blocks it needs."""
    T = cfg.max_num_batched_tokens
    S = min(seqs, T)
    bs = cfg.block_size
    lens = [T // S + (1 if i < T % S else 0) for i in range(S)]
    out, nxt = SchedulerOutput(), 1
    for i, n in enumerate(lens):
        d = min(k, n - 1)
        toks = [(7 * j) % mcfg.vocab_size for j in range(n)]
        req = Request(f"profile-{i}", toks[:n - d], params, 1)
        nb = -(-n // bs)
        out.scheduled.append(ScheduledRequest(req, 0, n, list(range(nxt, nxt + nb)), toks[n - d:]))
        nxt += nb
    return out, nxt


def _longest(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    """The longest sequence a request may reach before the budget caps it."""
    return cfg.max_model_len or mcfg.max_position_embeddings


def _last_chunk_step(mcfg: ModelConfig, cfg: EngineConfig, longest: int,
                     params: SamplingParams) -> tuple[SchedulerOutput, int]:
    """The last chunk (max_num_batched_tokens tokens) of a prompt of `longest` tokens: the
    step whose attention sees the most keys; -> the step and the KV blocks it needs."""
    T, bs = min(cfg.max_num_batched_tokens, longest), cfg.block_size
    toks = [(7 * j) % mcfg.vocab_size for j in range(longest)]
    nb = -(-longest // bs)
    out = SchedulerOutput()
    out.scheduled.append(ScheduledRequest(Request("profile-long", toks, params, 1), longest - T, T,
                                          list(range(1, nb + 1))))
    return out, nb + 1


def profile_peak(model: torch.nn.Module, mcfg: ModelConfig, cfg: EngineConfig,
                 dtype: torch.dtype, device: torch.device, backend: str) -> int:
    """Peak activation memory of the largest step the scheduler may build, sampler included:
    the larger of a full step over max_num_seqs sequences (the sampler's rows) and the last
    chunk of a max_model_len prompt (the attention's keys: on the SDPA paths, with 2 sequences,
    the second had ~40 MB more than the first at 2,048 tokens after 2,048)."""
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01)
    # Speculation: each request verifies k drafts, so k + 1 sampled rows each (the sampler's
    # [rows, vocab] temporaries grow with them).
    k = cfg.num_speculative_tokens if cfg.speculative_method else 0
    steps = [_full_step(mcfg, cfg, cfg.max_num_seqs, k, params)]
    if device.type != "cuda":  # the Triton kernel reads paged KV in place: no [rows, keys] temps
        steps.append(_last_chunk_step(mcfg, cfg, _longest(cfg, mcfg), params))
    peak = 0
    for out, blocks in steps:
        runner = ModelRunner(model, mcfg, blocks, cfg.block_size, dtype, device, backend)
        with dev.PeakTracker(device) as tracker:
            runner.execute(out, Sampler(mcfg.vocab_size, frozenset(), 0))
        del runner
        dev.release_freed_memory(device)  # the next step's peak is measured from here
        peak = max(peak, tracker.peak)
    return peak


def warm_heap(model: torch.nn.Module, mcfg: ModelConfig, cfg: EngineConfig,
              dtype: torch.dtype, device: torch.device, backend: str) -> None:
    """CPU: once freed memory is kept (device.keep_freed_heap), one greedy prompt step of
    max_num_batched_tokens tokens grows the heap to what prompt steps need, so the first real
    ones do not fault it in page by page (30-50k faults, ~0.25 s of the CPU benchmark's prompt
    steps at 16 requests: the git history of docs/benchmarks/cpu.md). As few sequences as
    max_model_len allows (one chunk of a long prompt, a step the scheduler builds), one sampled
    row each: the profile's worst-case sampler rows would hold far more than real steps use.
    Its KV pool is mapped outside the heap (on_demand), as the serving pool is: in the heap its
    pages (36 MB for the default model's 2,048 tokens) stayed with the process as free heap the
    steps never needed, the serving pool being a mapping of its own."""
    seqs = -(-cfg.max_num_batched_tokens // _longest(cfg, mcfg))
    out, blocks = _full_step(mcfg, cfg, seqs, 0, SamplingParams(max_tokens=1, temperature=0))
    runner = ModelRunner(model, mcfg, blocks, cfg.block_size, dtype, device, backend, on_demand=True)
    runner.execute(out, Sampler(mcfg.vocab_size, frozenset(), 0))
    del runner


def start_up(cfg: EngineConfig, tp: TPGroup | None = None
             ) -> tuple[EngineState, Any, ModelRunner, ModelRunner | None]:
    """-> state, tokenizer, target runner, draft runner (speculative_method 'draft' only).

    With `tp` (tensor parallelism) every rank runs this in lockstep: its shard of the weights,
    its own profile and budget (the block count then agreed as the ranks' minimum), its own
    KV pool for its KV heads."""
    device = tp.device if tp is not None else dev.select_device(cfg.device)
    if device.type == "cuda" and device.index is not None:  # a data-parallel replica's GPU
        torch.cuda.set_device(device)
    if cfg.attention_backend:
        dev.check_backend(cfg.attention_backend, device)
    dtype = dev.resolve_dtype(cfg.dtype, device)
    dev.map_large_allocations(device)  # until keep_freed_heap: no holes left in the heap
    src, hf, mcfg = _model_config(cfg.model)
    # Under tensor parallelism too: each rank cuts its shard from the blocks (distributed/quant_shards.py).
    keep = _keep_quantized(cfg, device)
    # Before the tokenizer too (a GGUF's is converted at load, seconds): runtime is lower here.
    if tp is None:  # a rank's share is planned below, per rank
        _preflight(cfg, mcfg, dtype, dev.probe_memory(device),
                   dev.process_rss() if device.type != "cuda" else 0, keep or src.is_gguf)
    tokenizer = load_tokenizer(src, cfg.tokenizer)
    runtime = dev.process_rss() if device.type != "cuda" else 0  # interpreter, torch, tokenizer
    probe = dev.probe_memory(device)  # before our weights: on a GPU, "in use" means others
    cfg = _with_step_limits(cfg, mcfg, device, dtype, probe.total)
    # Only now the kernels (loaded from scripts/setup.sh's builds; a changed source builds here).
    backend = cfg.attention_backend or kernels.default_backend(device)
    fused = ops.parse_fused_ops(cfg.fused_ops, backend)
    # The packed CPU linears (AMX, oneDNN) and the C++ decoder stack have no all-reduce inside.
    gemm = "torch" if tp is not None else _cpu_gemm(cfg, device, dtype)
    shard, full = None, mcfg
    if tp is not None:
        from flatserve.distributed import parallel

        probe = parallel.host_share(probe, tp)
        mcfg = parallel.local_config(mcfg, tp.size)  # this rank's heads: its KV pool, its budget
        shard = functools.partial(parallel.shard_model, g=tp)
    model, weights = _load_weights(src, hf, full, dtype, device, shard, keep, cfg.load_format == "dummy")
    if cfg.quantization:
        weights = _quantize(model, device, cfg.quantization)
    if gemm != "torch":
        weights += _pack(model, device, gemm, cfg.copy_tied_lm_head)
    greedy = _greedy_head(model, mcfg, gemm, cfg.greedy_int8_head)
    weights += greedy.nbytes if greedy is not None else 0
    draft = _load_draft(cfg, mcfg, dtype, device, gemm)
    ops.enable(model, fused, backend)
    if draft:
        ops.enable(draft[0], fused, backend)
    # The rope tables for every position a request may reach, built before the steps below and
    # counted as weights: grown lazily inside steps, they were memory the budget never saw
    # (and each layer held its own copy before share_rope_tables).
    models = [model] + ([draft[0]] if draft else [])
    longest = _longest(cfg, mcfg)
    rope = sum(r.build(longest + 1) for m in models for r in share_rope_tables(m))
    peak = profile_peak(model, mcfg, cfg, dtype, device, backend)
    dev.release_freed_memory(device)
    # From here freed memory stays with the process: the heap grows to what the workload's steps
    # need and stays there. Not before the profile: its worst case (max_num_seqs = 64 sequences
    # x k + 1 rows of fp32 logits and the sampler's copies, with speculation) held 0.6 GB more
    # than the benchmark's steps ever use.
    if dev.keep_freed_heap(device):
        warm_heap(model, mcfg, cfg, dtype, device, backend)
    budget = _plan_budget(cfg, mcfg, dtype, probe, tp, draft, weights + rope, peak, runtime)
    if budget.max_model_len < longest:  # the budget capped the context: smaller tables
        for m in models:
            for r in share_rope_tables(m):
                r.build(budget.max_model_len + 1)
    graphs = 0 if cfg.enforce_eager else cfg.max_num_seqs
    runner = ModelRunner(model, mcfg, budget.num_blocks, cfg.block_size, dtype, device, backend,
                         graph_max_seqs=graphs, max_model_len=budget.max_model_len, on_demand=True,
                         greedy_head=greedy, cpu_stack=not cfg.enforce_eager and tp is None)
    draft_runner = None if draft is None else ModelRunner(
        draft[0], draft[1], budget.num_blocks, cfg.block_size, dtype, device, backend,
        on_demand=True, cpu_stack=not cfg.enforce_eager)
    for m in models:  # the CPU decoder stack copied the layers' blocks into tensors of its own
        _release_checkpoint_pages(m)
    from flatserve.model.quant import summary

    state = EngineState(full, src, device, dtype, backend, budget,
                        _eos_ids(mcfg, tokenizer, src), weights, fused, gemm, cfg,
                        tuple((k, n, b) for k, (n, b) in sorted(summary(model).items())))
    return state, tokenizer, runner, draft_runner


def _with_step_limits(cfg: EngineConfig, mcfg: ModelConfig, device: torch.device,
                      dtype: torch.dtype, total: int) -> EngineConfig:
    """cfg with max_num_seqs / max_num_batched_tokens sized by the device where unset."""
    limits = size_limits(cfg.max_num_seqs, cfg.max_num_batched_tokens, device.type, total,
                         mcfg.hidden_size, mcfg.intermediate_size,
                         torch.empty((), dtype=dtype).element_size(),
                         device.type != "cpu" or dev.cpu_has_fast_bf16(),
                         device.type != "cpu" or dev.cpu_has_amx_bf16())
    log.info(limits.line())
    return dataclasses.replace(cfg, max_num_seqs=limits.max_num_seqs,
                               max_num_batched_tokens=limits.max_num_batched_tokens)


def _plan_budget(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, probe: Any,
                 tp: TPGroup | None, draft: tuple | None, weights: int, peak: int,
                 runtime: int) -> Any:
    """The memory budget (memory.plan; with tensor parallelism agreed by the ranks)."""
    elt = torch.empty((), dtype=dtype).element_size()
    # One block id addresses a target block and (with a draft model) a draft block: budget both.
    per_token = mcfg.kv_bytes_per_token + (draft[1].kv_bytes_per_token if draft else 0)
    breq = BudgetRequest(
        weights=weights + (draft[2] if draft else 0), peak_activations=peak,
        bytes_per_block=per_token * cfg.block_size * elt,
        block_size=cfg.block_size, model_max_len=mcfg.max_position_embeddings,
        max_model_len=cfg.max_model_len, os_reserve_gb=_os_reserve(cfg),
        gpu_memory_utilization=cfg.gpu_memory_utilization, kv_cache_memory=cfg.kv_cache_memory,
        num_blocks_override=cfg.num_gpu_blocks_override, runtime=runtime,
        max_num_seqs=cfg.max_num_seqs)
    if tp is None:
        budget = plan(probe, breq)
        log.info(budget.startup_line())
        return budget
    from flatserve.distributed.parallel import agree_budget

    return agree_budget(probe, breq, tp)


def _preflight(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, probe: Any,
               runtime: int, quantized: bool = False) -> None:
    """Refuse in seconds a start that cannot fit even before activations: the budget with the
    weights counted from the model's shapes (built on the meta device: nothing allocated or
    read) and no peak, ahead of any kernel build or weight load. A start that passes is
    planned again below with the measured weights and peak."""
    with torch.device("meta"):  # its first use imports torch._dynamo (build_model's does too)
        shapes = get_model_class(mcfg.architecture)(mcfg)
    seen = {id(p): p.numel() for p in shapes.parameters()}  # a tied head counted once
    # A lower bound of what loading leaves: block formats hold at least 4 bits a parameter
    # (Q4_0 is 4.5; a GGUF's or --quantization's weights), dense weights their dtype's bytes.
    elt = torch.empty((), dtype=dtype).element_size()
    weights = int(sum(seen.values()) * (0.5 if quantized or cfg.quantization else elt))
    per_token = mcfg.kv_bytes_per_token * cfg.block_size * torch.empty((), dtype=dtype).element_size()
    try:
        plan(probe, BudgetRequest(
            weights=weights, peak_activations=0, bytes_per_block=per_token,
            block_size=cfg.block_size, model_max_len=mcfg.max_position_embeddings,
            max_model_len=cfg.max_model_len, os_reserve_gb=_os_reserve(cfg),
            gpu_memory_utilization=cfg.gpu_memory_utilization, kv_cache_memory=cfg.kv_cache_memory,
            num_blocks_override=cfg.num_gpu_blocks_override, runtime=runtime,
            max_num_seqs=cfg.max_num_seqs))
    except BudgetError as e:
        raise BudgetError(f"{e} (Checked before loading: weights counted from the model's "
                          f"shapes, activations not yet measured.)") from None


def _model_config(model: str | None) -> tuple[ModelSource, Any, ModelConfig]:
    src = resolve_model(model)
    hf = load_hf_config(src)
    get_model_class((getattr(hf, "architectures", None) or [""])[0])  # unsupported -> ValueError
    return src, hf, ModelConfig.from_hf(hf)


def _keep_quantized(cfg: EngineConfig, device: torch.device) -> bool:
    """GGUF block formats stay as stored unless --dequantize, on the CPU and on CUDA (the
    Triton kernels; from 16 rows a step they are slower than cuBLAS on dequantized weights,
    docs/performance-gpu.md "Quantized weights": --dequantize trades the memory for that)."""
    return not cfg.dequantize and device.type in ("cpu", "cuda")


def _tensor_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers (quantized weights are buffers), shared tensors counted once."""
    seen = {t.data_ptr(): t.numel() * t.element_size()
            for t in itertools.chain(model.parameters(), model.buffers())}
    return sum(seen.values())


def _load_weights(src: ModelSource, hf: Any, mcfg: ModelConfig, dtype: torch.dtype,
                  device: torch.device, shard: Any = None,
                  keep_quantized: bool = False, dummy: bool = False) -> tuple[torch.nn.Module, int]:
    before = dev.process_rss() if device.type != "cuda" else 0
    model = build_model(src, hf, mcfg, dtype, device, shard, keep_quantized and not dummy, dummy)
    dev.release_freed_memory(device)
    _release_checkpoint_pages(model)  # the file pages of shards copied into fused linears
    weights = _tensor_bytes(model)
    if device.type != "cuda":  # what loading really left resident (allocator slack included)
        weights = max(weights, dev.process_rss() - before)
    return model, weights


def _release_checkpoint_pages(model: torch.nn.Module) -> None:
    """Unmap the checkpoint file's pages that none of the model's tensors reads any more
    (device.release_file_pages says which and why); the rest of the mapping stays."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    freed = dev.release_file_pages(t for t in tensors if t.device.type == "cpu")
    if freed:
        log.debug("released %.1f MiB of checkpoint pages no tensor reads", freed / 2**20)


def _quantize(model: torch.nn.Module, device: torch.device, name: str) -> int:
    """--quantization: linears to block format `name` in place; -> the weights' bytes now."""
    from flatserve.model.quant import quantize_model

    quantize_model(model, name)
    dev.release_freed_memory(device)
    return _tensor_bytes(model)


def _cpu_gemm(cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The linears' path: cfg.cpu_gemm where it applies; for auto the first of amx, onednn,
    avx2 (CPU, bf16 weights not quantized; oneDNN with native bf16 / AMX kernel built / AVX2 +
    FMA kernel built) or torch."""
    from flatserve.model import amx, avx2, onednn

    if cfg.cpu_gemm == "torch" or (device.type != "cpu" and cfg.cpu_gemm == "auto"):
        return "torch"
    fits = device.type == "cpu" and not cfg.quantization
    ok = {"amx": lambda: amx.available(dtype), "onednn": lambda: onednn.available(dtype),
          "avx2": lambda: avx2.available(dtype)}
    if cfg.cpu_gemm == "auto":  # each check may build its kernel: stop at the first that runs
        return next((name for name, can in ok.items() if fits and can()), "torch")
    if not (fits and ok[cfg.cpu_gemm]()):
        need = {"amx": " and a CPU with AMX bf16", "avx2": " (here: a CPU with AVX2 + FMA and "
                "the kernel built)"}.get(cfg.cpu_gemm, " and a torch with oneDNN on a CPU with "
                                                      "native bf16")
        raise ValueError(f"cpu_gemm {cfg.cpu_gemm!r} needs the CPU, bf16 weights without "
                         f"quantization{need}; here: device {device.type}, dtype {dtype}, "
                         f"quantization {cfg.quantization}")
    return cfg.cpu_gemm


def _pack(model: torch.nn.Module, device: torch.device, gemm: str, copy_tied: bool) -> int:
    """Linears into the `gemm` path's packed layout in place; -> bytes added (a tied LM head's
    second copy, where one is made)."""
    from flatserve.model import amx, avx2, onednn

    if gemm == "amx":
        added = amx.pack_linears(model, copy_tied)
    else:
        added = avx2.pack_linears(model) if gemm == "avx2" else onednn.pack_linears(model)
    dev.release_freed_memory(device)
    return added


def _greedy_head(model: torch.nn.Module, mcfg: ModelConfig, gemm: str,
                 want: bool | None) -> torch.nn.Module | None:
    """The bounded greedy head where its argmax is the model's: for a CPU Q8_0 LM head (a
    GGUF's, kept quantized) the int8 pass with a 4-bit copy for few rows (model/greedy_q8.py,
    AVX-512 VNNI or AVX2); for an AMX or AVX2 LM head (the
    AVX2 kernel's vector build) without bias whose logits are used as they are (no softcap) the
    7-bit copy; else None. `want` None (auto): not for an AMX head (EngineConfig's comment)."""
    from flatserve.model import amx, avx2, greedy_q8, quant
    from flatserve.model.greedy_head import Int8GreedyHead

    if want is False or (want is None and gemm == "amx"):
        return None
    head = getattr(model, "lm_head", None)
    if isinstance(head, quant.QuantLinear):  # its kernel is the CPU extension: CPU heads only
        if head.qweight0.device.type != "cpu":
            return None
        return greedy_q8.for_model(model, mcfg)  # avx512 and avx2 builds (avx2: greedy_q4's copy inside)
    ok = (gemm == "amx" and isinstance(head, amx.AMXLinear)) or \
        (gemm == "avx2" and isinstance(head, avx2.AVX2Linear) and head.ext.vectorized())
    if not ok or head.bias.numel() or mcfg.final_logit_softcap is not None:
        return None
    return Int8GreedyHead(head)


def _load_draft(cfg: EngineConfig, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                gemm: str) -> tuple[torch.nn.Module, ModelConfig, int] | None:
    if cfg.speculative_method != "draft":
        return None
    src, hf, mcfg = _model_config(cfg.speculative_model)
    if mcfg.vocab_size > target.vocab_size:
        raise ValueError(f"draft model vocabulary ({mcfg.vocab_size}) is larger than the target's "
                         f"({target.vocab_size}): the two must share a tokenizer")
    model, weights = _load_weights(src, hf, mcfg, dtype, device, keep_quantized=_keep_quantized(cfg, device))
    if cfg.quantization:
        weights = _quantize(model, device, cfg.quantization)
    if gemm != "torch":
        weights += _pack(model, device, gemm, cfg.copy_tied_lm_head)
    return model, mcfg, weights


def _os_reserve(cfg: EngineConfig) -> float | None:
    import os

    if cfg.os_reserve_gb is not None:
        return cfg.os_reserve_gb
    env = os.environ.get("FLATSERVE_OS_RESERVE_GB")
    if env is None:
        return None
    try:
        return float(env)
    except ValueError:
        raise ValueError(f"FLATSERVE_OS_RESERVE_GB must be a number, got {env!r}") from None
