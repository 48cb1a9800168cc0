"""ModelRunner: SchedulerOutput -> one flat batch -> one forward -> logits of sampled rows only."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from flatserve import device as dev
from flatserve.attention.base import get_backend
from flatserve.attention.metadata import AttentionMetadata, forward_context
from flatserve.engine.request import Request
from flatserve.engine.sampler import Group, Logprobs, Sampler, SamplingTensors, accept_walk, expand
from flatserve.engine.scheduler import SchedulerOutput
from flatserve.engine.structured import apply_bitmask, fill_bitmask
from flatserve.model.config import ModelConfig
from flatserve.model.cpu_stack import build as cpu_stack_build
from flatserve.model.cuda_stack import build as cuda_stack_build
from flatserve.model.layers import Attention, DecoderLayers


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [R] rows of the strip whose logits are sampled
    groups: list[Group]  # sampling requests with their drafts: k drafts own k + 1 rows
    # Async: flat positions whose token is still on the device, and whose request it is.
    pending_index: list[int]
    pending_ids: list[str]

    @property
    def num_rows(self) -> int:
        return sum(len(d) + 1 for _, d in self.groups)


def build_flat_batch(out: SchedulerOutput, block_size: int, device: torch.device) -> FlatBatch:
    """Pack every scheduled request's new tokens end to end; boundaries in cu_seqlens_q.

    numpy per sequence (not per token); a kernel can replace it behind this function.
    """
    sched = out.scheduled
    q_lens = np.fromiter((s.num_tokens for s in sched), np.int64, len(sched))
    starts = np.fromiter((s.start_pos for s in sched), np.int64, len(sched))
    cu = np.zeros(len(sched) + 1, np.int64)
    np.cumsum(q_lens, out=cu[1:])
    seq_lens = starts + q_lens
    # A pending token (async scheduling) is not on the host yet: -1 here, filled on the device.
    pend = [i for i, s in enumerate(sched) if s.request.num_pending]
    ids = np.fromiter(itertools.chain.from_iterable(
        s.new_token_ids + [-1] * (s.num_tokens - len(s.new_token_ids)) if s.request.num_pending
        else s.new_token_ids for s in sched), np.int64, int(cu[-1]))
    # Position of each token: its sequence's start plus its offset inside the sequence's run.
    seq_of_tok = np.repeat(np.arange(len(sched)), q_lens)
    positions = starts[seq_of_tok] + np.arange(cu[-1]) - cu[:-1][seq_of_tok]
    max_blocks = max(len(s.block_ids) for s in sched)
    table = np.zeros((len(sched), max_blocks), np.int32)  # padding -> null block 0
    for i, s in enumerate(sched):
        table[i, :len(s.block_ids)] = s.block_ids
    slots = table[seq_of_tok, positions // block_size].astype(np.int64) * block_size + positions % block_size
    sample_rows = [i for i, s in enumerate(sched) if s.samples]
    # A request verifying k drafts samples its last k + 1 rows (the last known token's, then each draft's).
    counts = np.fromiter((len(sched[i].spec_token_ids) + 1 for i in sample_rows), np.int64,
                         len(sample_rows))
    firsts = cu[1:][sample_rows] - counts  # [S'] first sampled row of each sampling request
    rows = np.repeat(firsts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    def put(a: np.ndarray) -> torch.Tensor:
        return dev.to_device(torch.from_numpy(a), device)

    meta = AttentionMetadata(
        cu_seqlens_q=put(cu.astype(np.int32)), seq_lens=put(seq_lens.astype(np.int32)),
        block_table=put(table), slot_mapping=put(slots), max_q_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()), cu_seqlens_q_host=cu.tolist(),
        seq_lens_host=seq_lens.tolist(), prompt_lens_host=[s.request.num_prompt_tokens for s in sched])
    return FlatBatch(put(ids), put(positions), meta, put(rows.astype(np.int64)),
                     [(sched[i].request, sched[i].spec_token_ids) for i in sample_rows],
                     [int(cu[i + 1]) - 1 for i in pend], [sched[i].request.request_id for i in pend])


class ModelRunner:
    def __init__(self, model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, backend: str,
                 graph_max_seqs: int = 0, max_model_len: int = 0, on_demand: bool = False,
                 greedy_head: nn.Module | None = None, cpu_stack: bool = False) -> None:
        self.model, self.cfg, self.block_size = model, cfg, block_size
        self.greedy_head = greedy_head  # hidden [S', H] -> argmax tokens (model/greedy_head.py)
        self.device, self.dtype = device, dtype
        self.backend = get_backend(backend)
        # One allocation for the whole pool: [layers, K|V, blocks, block_size, Hkv, D]. The
        # serving pool's host pages are mapped as blocks are first written (on_demand); start-up's
        # profile pools are filled up front so their pages sit below the measured peak.
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = (dev.zeros_on_demand(shape, dtype, device) if on_demand
                   else torch.zeros(shape, dtype=dtype, device=device))
        attn = [m for m in model.modules() if isinstance(m, Attention)]
        assert len(attn) == cfg.num_layers
        for i, layer in enumerate(attn):
            layer.bind(self.backend, (self.kv[i, 0], self.kv[i, 1]))  # [num_blocks, block_size, Hkv, D]
        # CPU decode steps: the decoder layers in one C++ call where the model runs on its
        # kernels (model/cpu_stack.py); CUDA one-token steps of q4_0 Llama-shaped models: the
        # norms and adds inside the GEMVs (model/cuda_stack.py); None keeps the Python layers.
        for m in model.modules():
            if isinstance(m, DecoderLayers):
                m.fast = cpu_stack_build(m, self.backend) if cpu_stack and device.type == "cpu" else \
                    cuda_stack_build(m, device) if device.type == "cuda" and backend == "triton" else None
        self.num_forward_tokens = 0  # tokens the model actually ran (prefix-cache tests read it)
        self.graphs = None
        if graph_max_seqs > 0 and dev.supports_cuda_graphs(device) and backend == "triton":
            from flatserve.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, graph_max_seqs, -(-max_model_len // block_size),
                                       max_model_len, device)
            self.graphs.capture()

    @torch.inference_mode()
    def forward_logits(self, batch: FlatBatch) -> torch.Tensor:
        S = batch.meta.num_seqs
        if (self.graphs is not None and batch.meta.is_decode_only and batch.num_rows == S
                and self.graphs.bucket(S) is not None):
            self.num_forward_tokens += S
            return self.graphs.replay(batch.input_ids, batch.positions, batch.meta)  # [S, V]
        return self.model.compute_logits(self.forward_hidden(batch))  # [S', V]

    @torch.inference_mode()
    def forward_hidden(self, batch: FlatBatch) -> torch.Tensor:
        """The sampled rows' final hidden states [S', H]."""
        with forward_context(batch.meta):
            hidden = self.model(batch.input_ids, batch.positions)  # [T, H]
        self.num_forward_tokens += batch.input_ids.shape[0]
        return hidden[batch.logits_index]

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, sampler: Sampler, prev: InFlight | None = None,
               before_masks: Callable[[], None] | None = None) -> InFlight | None:
        """Enqueue the step's forward and sampling; the sampled ids start their copy to the
        host. `prev` (async scheduling) holds the previous step's ids still on the device.
        With grammar-constrained rows, the host fills their token masks after the forward is
        enqueued; `before_masks` (async) first reads the previous step's tokens into the matchers."""
        batch = build_flat_batch(out, self.block_size, self.device)
        if batch.pending_index:
            assert prev is not None, "a pending token needs the step that sampled it"
            rows = [prev.row_of[rid] for rid in batch.pending_ids]
            src = dev.to_device(torch.tensor(rows, dtype=torch.int64), self.device)
            dst = dev.to_device(torch.tensor(batch.pending_index, dtype=torch.int64), self.device)
            batch.input_ids[dst] = prev.tokens[src]
        if not batch.groups:
            self.forward_hidden(batch)  # prompt chunks that sample nothing: KV writes only
            return None
        rows = expand(batch.groups)
        failed: dict[str, str] = {}
        try:
            st: SamplingTensors | None = sampler.prepare(rows, self.device)
        except Exception as e:  # one request's values: found and failed alone below
            _reraise_fatal(e)
            st = None
        constrained = any(r.req.grammar is not None for r in rows)
        if st is not None and not constrained and self.greedy_head is not None \
                and sampler.argmax_only(rows, st):
            tokens = self.greedy_head(self.forward_hidden(batch))  # [R], no [R, V] logits
            accepted = None if st.draft is None else tokens == st.draft
            logprobs: list[Logprobs | None] = [None] * len(rows)
        else:
            logits = self.forward_logits(batch)  # [R, V], enqueued: the host fills masks meanwhile
            if constrained:
                if before_masks is not None:
                    before_masks()
                mask = fill_bitmask(rows, logits.shape[-1])
                if mask is not None:
                    mask = dev.to_device(mask, self.device)
                    if st is None:  # the isolated path below samples from the masked logits
                        apply_bitmask(logits, mask)
                    else:
                        st.bitmask = mask
            try:
                if st is None:
                    raise _PrepareFailed
                tokens, accepted, logprobs = sampler.sample(logits, rows, st)
            except Exception as e:
                _reraise_fatal(e)
                tokens, accepted, logprobs, failed = sample_isolated(sampler, logits, batch.groups)
        # The step's one device->host copy, waited for in `collect`.
        host, wait = dev.copy_to_host_async(tokens if accepted is None
                                            else torch.stack([tokens, accepted.long()]))
        row_of = {r.request_id: i for i, (r, _) in enumerate(batch.groups)}
        return InFlight(batch.groups, tokens, accepted is not None, host, wait, logprobs, row_of,
                        failed)

    @staticmethod
    def collect(f: InFlight | None) -> tuple[list[Request], list[list[int]], list[list[Logprobs | None]]]:
        """-> sampling requests, the tokens each emits (accepted drafts + one), their logprobs."""
        if f is None:
            return [], [], []
        f.wait()
        reqs = [r for r, _ in f.groups]
        if not f.has_drafts:
            return reqs, [[t] for t in f.host.tolist()], [[lp] for lp in f.logprobs]
        emitted, acc = f.host.tolist()
        toks = accept_walk(f.groups, emitted, acc)
        lps, r = [], 0
        for (_, drafts), t in zip(f.groups, toks):
            lps.append(f.logprobs[r:r + len(t)])
            r += len(drafts) + 1
        return reqs, toks, lps

    def execute(self, out: SchedulerOutput, sampler: Sampler
                ) -> tuple[list[Request], list[list[int]], list[list[Logprobs | None]]]:
        """launch + collect: one synchronous step."""
        return self.collect(self.launch(out, sampler))


@dataclass(slots=True)
class InFlight:
    """A launched step: its sampled ids on the device and (being) copied to the host."""

    groups: list[Group]
    tokens: torch.Tensor  # [R] device: the next step's pending inputs are read from here
    has_drafts: bool
    host: torch.Tensor  # [R] or [2, R] (emitted, accepted) once `wait` returns
    wait: Callable[[], None]
    logprobs: list[Logprobs | None]
    row_of: dict[str, int]  # request id -> its row in `tokens` (no drafts in async mode)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its sampling raised


class _PrepareFailed(Exception):
    """The batch's sampling tensors could not be built: sample each request alone."""


def _reraise_fatal(e: Exception) -> None:
    """Errors that leave the device's state unknown stop the engine; the rest are one
    request's (a value the validation let through): that request fails, the step goes on."""
    msg = str(e)
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "CUDA error" in msg \
            or "device-side assert" in msg:
        raise e


def sample_isolated(sampler: Sampler, logits: torch.Tensor, groups: list[Group]
                    ) -> tuple[torch.Tensor, torch.Tensor | None, list[Logprobs | None], dict[str, str]]:
    """The batch's sampling raised: sample each request's rows alone, so only the requests that
    raise again fail. Their rows emit token 0 (never read: the engine finishes them first)."""
    toks, accs, lps, failed = [], [], [], {}
    r = 0
    for req, drafts in groups:
        n = len(drafts) + 1
        rows = expand([(req, drafts)])
        try:
            st = sampler.prepare(rows, logits.device)
            t, a, lp = sampler.sample(logits[r:r + n], rows, st)
        except Exception as e:
            _reraise_fatal(e)
            failed[req.request_id] = f"{type(e).__name__}: {e}"
            t, a, lp = torch.zeros(n, dtype=torch.int64, device=logits.device), None, [None] * n
        toks.append(t)
        accs.append(torch.zeros(n, dtype=torch.bool, device=logits.device) if a is None else a)
        lps.extend(lp)
        r += n
    has_drafts = any(d for _, d in groups)
    return torch.cat(toks), torch.cat(accs) if has_drafts else None, lps, failed
