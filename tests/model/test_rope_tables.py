"""Rotary tables: one per distinct (rope, head size), built at start-up for every position a
request may reach and counted in the memory budget, never grown inside a step."""
from __future__ import annotations

import random

import pytest

from flatserve.model.layers import Rotary
from tests.conftest import build_checkpoint


@pytest.mark.parametrize("family,tables", [("gemma3", 2), ("llama", 1), ("qwen3", 1)])
def test_layers_share_their_rope_table_and_steps_never_grow_it(family: str, tables: int,
                                                                tmp_path) -> None:
    """Gemma 3's local and global layers use two rope bases, so two tables; Llama and Qwen3 one.
    After start-up the tables cover max_model_len + 1 positions, and generating up to it
    leaves the very same tensors in place (no step reallocated them)."""
    from flatserve import LLM, SamplingParams

    path, _ = build_checkpoint(family, tmp_path)
    max_len = random.choice([96, 160, 200])
    llm = LLM(device="cpu", model=str(path), dtype="float32", max_model_len=max_len)
    model = llm.engine.runner.model
    rotaries = [m for m in model.modules() if isinstance(m, Rotary)]
    stores = {id(r.store) for r in rotaries}
    assert len(rotaries) > tables and len(stores) == tables
    before = {id(r.store): r.store.t for r in rotaries}
    assert all(t.shape[1] == max_len + 1 for t in before.values())
    prompt = [random.randrange(4, 500) for _ in range(max_len - 8)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    assert all(r.store.t is before[id(r.store)] for r in rotaries)
