"""The memory budget: how many KV blocks to allocate, or a refusal with the numbers.

Unified memory (CPU, Apple MPS, integrated GPUs) is shared with the OS and the user's apps:
keep a fixed tier for them and use the rest. A discrete GPU is the engine's alone: claim
`gpu_memory_utilization` of it (vLLM's rule). Either way KV gets what weights and the measured
activation peak leave, and the pool is allocated once, at start.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GiB = 1024**3
# Free RAM the KV pool leaves on shared memory, at start and while serving (RamWatch): below it
# the kernel starts reclaiming page cache hard, then swaps or OOM-kills. Capped by the reserve,
# so --os-reserve-gb 0 turns the watch off.
FREE_FLOOR = 1 * GiB


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    total: int  # bytes of RAM (unified) or device memory (discrete)
    available: int  # bytes free now
    unified: bool
    device: str  # "cpu", "mps", "cuda:0 (NVIDIA H100)", ...


@dataclass(frozen=True, slots=True)
class BudgetRequest:
    """Everything the arithmetic needs; built by the engine from config + measurements."""

    weights: int
    peak_activations: int
    bytes_per_block: int  # all layers, K and V, KV dtype
    block_size: int
    model_max_len: int
    max_model_len: int | None = None  # user's; None -> clamp the model's to what fits
    os_reserve_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None
    runtime: int = 0  # unified memory: the process before weights (interpreter, torch, tokenizer)
    max_num_seqs: int | None = None  # caps the pool at what max_num_seqs full sequences can use


@dataclass(frozen=True, slots=True)
class CacheBudget:
    num_blocks: int  # including the reserved null block
    block_size: int
    max_model_len: int
    clamped: bool  # max_model_len came from the model and was cut to what fits
    total: int
    reserve: int  # unified: os_reserve; discrete: (1 - utilization) * total
    weights: int
    peak: int
    kv_budget: int
    unified: bool
    device: str
    runtime: int = 0
    # Unified memory: what other processes held at start beyond the reserve (plus free_floor),
    # held back from the KV budget; and the free RAM the pool must leave while serving.
    others: int = 0
    free_floor: int = 0

    @property
    def token_capacity(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def startup_line(self) -> str:
        kind = "RAM" if self.unified else "device memory"
        if self.kv_budget and self.kv_budget != (self.total - self.reserve - self.runtime - self.others
                                                 - self.weights - self.peak):
            kind = "(--kv-cache-memory overrides) " + kind
        reserve = "os_reserve" if self.unified else "unclaimed"
        note = " (clamped to what fits)" if self.clamped else ""
        return (f"memory budget on {self.device}: {kind} {_g(self.total)} - {reserve} "
                f"{_g(self.reserve)} - runtime {_g(self.runtime)} - "
                f"{'other processes ' + _g(self.others) + ' - ' if self.others else ''}"
                f"weights {_g(self.weights)} - "
                f"peak {_g(self.peak)} = "
                f"KV {_g(self.kv_budget)} -> {self.num_blocks - 1} blocks x {self.block_size} = "
                f"{self.token_capacity} tokens; max context per request {self.max_model_len}{note}")


class BudgetError(ValueError):
    """Start-up refusal; the message is the one paragraph the user sees."""


def _g(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def os_reserve_bytes(ram: int, override_gb: float | None) -> int:
    """4 GB up to 16 GB of RAM, 6 up to 64, 8 up to 128, else 12.

    "GB" here is GiB throughout: a "16 GB" Mac reports 16 GiB of RAM.
    """
    if override_gb is not None:
        if override_gb < 0:
            raise BudgetError(f"os reserve must be >= 0 GB, got {override_gb}")
        return int(override_gb * GiB)
    for limit, reserve in ((16, 4), (64, 6), (128, 8)):
        if ram <= limit * GiB:
            return reserve * GiB
    return 12 * GiB


def plan(probe: MemoryProbe, req: BudgetRequest) -> CacheBudget:
    """The budget's arithmetic; raises BudgetError with the whole story when nothing fits."""
    others = floor = 0
    if probe.unified:
        reserve = os_reserve_bytes(probe.total, req.os_reserve_gb)
        # RAM other processes hold counts: the rest of the machine keeps the reserve or what it
        # holds now plus a free floor, whichever is more (as the GPU path plans on free device
        # memory). The probe is taken with our runtime loaded: `available` already excludes it.
        # Not available - reserve: on the 24 GiB dev box with 3.4 GiB available (8 helpers'
        # tests) that refused to start a 0.2 GiB model; the reserve is meant for those processes.
        floor = min(reserve, FREE_FLOOR)
        held = max(0, probe.total - probe.available - req.runtime)
        others = max(0, held + floor - reserve)
    else:
        reserve = int(probe.total * (1 - req.gpu_memory_utilization))
        # As vLLM: the probe is taken before our weights load, so "in use" is other processes.
        if probe.total - reserve > probe.available and req.kv_cache_memory is None:
            raise BudgetError(
                f"Refusing to start on {probe.device}: gpu_memory_utilization "
                f"{req.gpu_memory_utilization} asks for {_g(probe.total - reserve)} of "
                f"{_g(probe.total)}, but only {_g(probe.available)} is free "
                f"({_g(probe.total - probe.available)} already in use by other processes). "
                f"Free the GPU or lower --gpu-memory-utilization.")
    kv_budget = probe.total - reserve - req.runtime - others - req.weights - req.peak_activations
    if req.kv_cache_memory is not None:
        kv_budget = req.kv_cache_memory
    if req.num_blocks_override is not None:
        num_blocks = req.num_blocks_override
    else:
        num_blocks = max(0, kv_budget) // req.bytes_per_block
    capacity = max(0, num_blocks - 1) * req.block_size
    max_len, clamped = req.max_model_len, False
    if max_len is None:
        max_len = min(req.model_max_len, capacity)
        clamped = max_len < req.model_max_len
    need_blocks = -(-max_len // req.block_size)
    if req.max_num_seqs and req.num_blocks_override is None and req.kv_cache_memory is None:
        # More blocks than max_num_seqs full-length sequences can hold would only ever serve the
        # prefix cache; on shared memory that RAM is worth more to the desktop.
        num_blocks = min(num_blocks, req.max_num_seqs * need_blocks + 1)
    budget = CacheBudget(num_blocks, req.block_size, max_len, clamped, probe.total, reserve,
                         req.weights, req.peak_activations, kv_budget, probe.unified, probe.device,
                         req.runtime, others, floor)
    if need_blocks > num_blocks - 1 or max_len < 2:
        raise BudgetError(_refusal(budget, req, max(max_len, 2)))
    return budget


def _refusal(b: CacheBudget, req: BudgetRequest, max_len: int) -> str:
    need = -(-max_len // req.block_size) * req.bytes_per_block
    if b.unified:
        head = (f"RAM {_g(b.total)} - os_reserve {_g(b.reserve)} - runtime {_g(b.runtime)} - "
                f"{'other processes ' + _g(b.others) + ' - ' if b.others else ''}"
                f"weights {_g(b.weights)} - peak activations {_g(b.peak)} leaves {_g(max(0, b.kv_budget))} for the KV cache")
    else:
        head = (f"device memory {_g(b.total)} x gpu_memory_utilization {req.gpu_memory_utilization} "
                f"- weights {_g(b.weights)} - peak activations {_g(b.peak)} leaves "
                f"{_g(max(0, b.kv_budget))} for the KV cache")
    return (f"Refusing to start on {b.device}: {head} ({max(0, b.num_blocks - 1)} blocks of "
            f"{b.block_size} tokens), but one sequence of max_model_len {max_len} needs {_g(need)}. "
            f"To fit: lower --max-model-len, lower --os-reserve-gb (or FLATSERVE_OS_RESERVE_GB), "
            f"set --kv-cache-memory, or lower --max-num-batched-tokens to shrink the peak.")


class RamWatch:
    """While serving on shared memory: the KV pool stops growing while available RAM is under
    the floor (`CacheBudget.free_floor`), and grows again once it is back above it by `hysteresis`.

    The start-up plan saw the RAM available then; other processes may take more later. Growth
    is new pages of the pool (blocks never written before, `BlockPool.fresh_limit`); blocks it
    already holds are reused, and the scheduler preempts or queues when they run out. One read
    of /proc/meminfo (psutil, ~30 us) every `interval` seconds.
    """

    def __init__(self, reserve: int, available: Callable[[], int], interval: float = 0.5,
                 hysteresis: int = 256 * 2**20) -> None:
        self.reserve, self.available, self.interval = reserve, available, interval
        self.hysteresis = hysteresis
        self.frozen = False
        self.num_freezes = 0
        self._next = 0.0

    def frozen_now(self, now: float) -> bool:
        if now >= self._next:
            self._next = now + self.interval
            free = self.available()
            if not self.frozen and free < self.reserve:
                self.frozen, self.num_freezes = True, self.num_freezes + 1
            elif self.frozen and free >= self.reserve + self.hysteresis:
                self.frozen = False
        return self.frozen
