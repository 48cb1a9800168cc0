"""load_format="dummy": a directory with config.json and a tokenizer alone serves random weights
(the GPU speed runs at 20-30B shapes write no checkpoint). No file but the config is read."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.moe_ckpt import moe_hf_config



def _config_dir(tmp_path: Path, family: str) -> Path:
    from flatserve.bench.random_ckpt import word_tokenizer

    cfg = moe_hf_config(family)
    cfg.save_pretrained(tmp_path)
    word_tokenizer(cfg.vocab_size).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_dummy_weights_from_config_alone(tmp_path: Path, family: str) -> None:
    from flatserve import LLM, SamplingParams

    d = _config_dir(tmp_path, family)
    assert not list(d.glob("*.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(model=str(d), dtype="float32", device="cpu")
    llm = LLM(model=str(d), dtype="float32", device="cpu", load_format="dummy")
    params = dict(llm.engine.runner.model.named_parameters())
    norms = [p for n, p in params.items() if p.dim() == 1 and not n.endswith(("bias", "sinks"))]
    biases = [p for n, p in params.items() if n.endswith(("bias", "sinks"))]
    mats = [p for p in params.values() if p.dim() >= 2]
    assert norms and mats and all(bool((p == 1).all()) for p in norms)
    assert all(bool((p == 0).all()) for p in biases)
    flat = torch.cat([p.detach().flatten() for p in mats])
    assert abs(flat.std().item() - 0.02) < 0.002 and abs(flat.mean().item()) < 1e-3
    outs = llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]


@pytest.mark.parametrize("bad", ["bogus", "", "DUMMY", 3, None, float("nan")])
def test_bad_load_format_is_refused_with_its_name(bad, capsys) -> None:
    from flatserve.cli import main
    from flatserve.config import EngineConfig

    with pytest.raises(ValueError, match="load_format must be auto or dummy"):
        EngineConfig.from_kwargs(load_format=bad)
    if isinstance(bad, str):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--load-format", bad])
        assert e.value.code == 2 and "--load-format" in capsys.readouterr().err
