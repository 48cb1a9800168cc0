"""Start-up's peak profile covers both worst steps the scheduler can build on the CPU: a full
step over max_num_seqs sequences (the sampler's rows) and the last chunk of a max_model_len
prompt (the attention's keys)."""
from __future__ import annotations

import random

import torch

from flatserve.config import EngineConfig
from flatserve.engine import startup
from flatserve.runner import ModelRunner
from tests.conftest import build_checkpoint


def test_profile_runs_the_full_step_and_the_last_long_chunk(tmp_path, monkeypatch) -> None:
    path, _ = build_checkpoint("llama", tmp_path)
    T, L = random.choice([(64, 300), (96, 257), (128, 512)])
    cfg = EngineConfig.from_kwargs(model=str(path), dtype="float32", attention_backend="torch",
                                   max_model_len=L, max_num_batched_tokens=T, max_num_seqs=4)
    src, hf, mcfg = startup._model_config(cfg.model)
    model, _ = startup._load_weights(src, hf, mcfg, torch.float32, torch.device("cpu"))
    seen = []
    inner = ModelRunner.execute

    def spy(self, out, sampler):
        seen.append([(s.start_pos, s.num_tokens) for s in out.scheduled])
        return inner(self, out, sampler)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    peak = startup.profile_peak(model, mcfg, cfg, torch.float32, torch.device("cpu"), "torch")
    assert peak >= 0 and len(seen) == 2
    full, last = seen
    assert len(full) == 4 and sum(n for _, n in full) == T and all(p == 0 for p, _ in full)
    assert last == [(L - T, T)]  # positions L - T .. L - 1: every key a request may see
