"""The sharded model itself, without processes: every rank of a gloo group on its own thread of
this process (the collectives are real), one flat ragged step, logits at every position against
the unsharded model and transformers. Fast; the spawned-process path is test_tensor_parallel."""
from __future__ import annotations

import functools
import random
import threading

import pytest
import torch

from flatserve.distributed import parallel
from flatserve.distributed.group import Topology, TPGroup, open_store
from flatserve.engine.request import Request
from flatserve.engine.sampling_params import SamplingParams
from flatserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from flatserve.model.config import ModelConfig
from flatserve.model.loader import build_model, load_hf_config, resolve_model
from flatserve.runner import ModelRunner, build_flat_batch

CPU = torch.device("cpu")
ATOL = 1e-4  # fp32; TP sums the same products in another order (seen: ~6e-6)


def _logits(model, cfg: ModelConfig, prompts: list[list[int]]) -> torch.Tensor:
    out, nxt = SchedulerOutput(), 1
    for i, p in enumerate(prompts):
        nb = -(-len(p) // 16)
        out.scheduled.append(ScheduledRequest(Request(str(i), p, SamplingParams(), 1), 0, len(p),
                                              list(range(nxt, nxt + nb))))
        nxt += nb
    runner = ModelRunner(model, cfg, nxt, 16, torch.float32, CPU, "torch")
    batch = build_flat_batch(out, 16, CPU)
    batch.logits_index = torch.arange(sum(map(len, prompts)))
    return runner.forward_logits(batch)  # [T, V]


def _sharded(src, mcfg: ModelConfig, size: int, prompts) -> list[torch.Tensor]:
    from flatserve.attention.metadata import per_thread_scopes

    per_thread_scopes()  # the ranks' threads run their forwards at the same time
    topo = Topology(size, timeout_s=60)
    master = open_store(0, topo)
    topo = Topology(size, master_port=master.port, timeout_s=60)
    res: list = [None] * size

    def rank(r: int) -> None:
        try:
            g = TPGroup(r, topo, master if r == 0 else open_store(r, topo), CPU)
            m = build_model(src, None, mcfg, torch.float32, CPU,
                            functools.partial(parallel.shard_model, g=g))
            res[r] = _logits(m, parallel.local_config(mcfg, size), prompts)
        except BaseException as e:  # noqa: BLE001 - reported below
            res[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    for r in res:
        if isinstance(r, BaseException):
            raise r
    return res


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks > 2 KV heads: each KV head on 2 ranks
def test_sharded_logits_equal_unsharded_and_transformers(tiny_checkpoint, size: int) -> None:
    family, path, hf = tiny_checkpoint
    src = resolve_model(str(path))
    mcfg = ModelConfig.from_hf(load_hf_config(src))
    rng = random.Random(random.randrange(1 << 30))
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(1, 70))] for _ in range(5)]
    ref = _logits(build_model(src, None, mcfg, torch.float32, CPU), mcfg, prompts)
    with torch.no_grad():
        hf_ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (ref - hf_ref).abs().max().item() < ATOL
    if mcfg.num_heads % size:  # a family with fewer query heads than ranks: refused by name
        with pytest.raises(ValueError, match="not divisible by tensor_parallel_size"):
            _sharded(src, mcfg, size, prompts)
        return
    for r, got in enumerate(_sharded(src, mcfg, size, prompts)):
        err = (got - ref).abs().max().item()
        assert err < ATOL, f"{family} tp={size} rank {r}: max abs logit error {err:.2e}"


def test_shard_shapes_and_kv_placement() -> None:
    """Which KV head each rank keeps: sharded when Hkv >= tp, else replicated on tp / Hkv ranks."""
    assert parallel.kv_heads_per_rank(8, 2) == 4
    assert parallel.kv_heads_per_rank(2, 4) == 1
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) is not divisible"):
        parallel.kv_heads_per_rank(3, 2)
    with pytest.raises(ValueError, match="must divide or be a multiple"):
        parallel.kv_heads_per_rank(2, 3)
