"""What a CPU-only engine keeps resident: no GPU compiler stack (triton, torch._dynamo), no
symbolic maths (sympy: torch's Python refs import it through torch.fx) and no Python copies of
the tokenizer's vocabulary (docs/performance-cpu.md, the RSS paragraph)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import build_checkpoint

# A fresh interpreter: the test process itself has imported torch._dynamo (transformers, other
# tests). Greedy and sampled rows both run, so the sampler's paths are covered too.
# torchvision is hidden from the child: where it is installed (the GPU hosts' image), transformers'
# LlamaConfig imports it (5.x: utils/type_validators -> video_utils -> image_utils), and its ops
# import torch._dynamo and with it triton before the engine runs a line of its own. That is the
# environment's footprint, not the engine's; the CPU machines the RSS figures come from have no
# torchvision, so there the child runs as before.
CHILD = r"""
import json, sys
sys.modules["torchvision"] = None  # find_spec -> None: transformers sees no torchvision
from flatserve import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=2, max_model_len=256,
          max_num_batched_tokens=64, dequantize=sys.argv[2] == "1")
WATCH = ("triton", "torch._dynamo", "sympy")
started = {m: m in sys.modules for m in WATCH}
llm.generate(["The capital of France is", "Hi"], SamplingParams(max_tokens=4, temperature=0),
             use_tqdm=False)
llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1), use_tqdm=False)
print("MODULES " + json.dumps({"started": started,
                               "ran": {m: m in sys.modules for m in WATCH}}))
"""


def _modules(model: str, dequantize: bool = False) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, model, "1" if dequantize else "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("MODULES "))[8:])


NO_GPU_STACK = {"triton": False, "torch._dynamo": False}
NONE = {**NO_GPU_STACK, "sympy": False}


def test_default_gguf_cpu_engine_never_imports_triton_or_dynamo(default_model_path) -> None:
    """Building the model on the meta device ran nn.Embedding's normal_ and the rope frequencies
    through torch's Python refs, whose first call imports torch._dynamo and triton: 66 MB of
    libtriton.so and ~40 MB of modules resident in an engine that compiles nothing. Module.to_empty
    on the meta model imported sympy the same way (empty_like's Python ref: +34 MiB RSS, ~490
    modules); loader._materialize allocates the tensors itself."""
    assert _modules(str(default_model_path)) == {"started": NONE, "ran": NONE}


@pytest.mark.parametrize("family", ["llama", "phi3-longrope"])  # llama3 and LongRoPE frequencies
def test_hf_checkpoint_cpu_engine_never_imports_triton_or_dynamo(family, tmp_path) -> None:
    """sympy is not checked here: transformers 5's AutoConfig for these families imports it
    (configuration_llama -> activations -> hub_kernels -> core_model_loading -> torch.distributed.tensor
    -> torch.fx's symbolic shapes), before the engine builds anything."""
    path, _ = build_checkpoint(family, tmp_path)
    got = _modules(str(path))
    assert {k: {m: v[m] for m in ("triton", "torch._dynamo")} for k, v in got.items()} == \
        {"started": NO_GPU_STACK, "ran": NO_GPU_STACK}


def test_tokenizer_keeps_no_python_vocab_and_encodes_the_same(default_model_path) -> None:
    from transformers import AutoTokenizer

    from flatserve.engine.startup import load_tokenizer
    from flatserve.model.loader import resolve_model

    src = resolve_model(str(default_model_path))
    tok, ref = load_tokenizer(src, None), AutoTokenizer.from_pretrained(**src.hf_kwargs)
    assert len(getattr(ref, "_vocab", ())) == 262144  # what the drop is for: still there upstream
    assert not hasattr(tok, "_vocab") and not hasattr(tok, "_merges")
    assert len(ref.init_kwargs["added_tokens_decoder"]) > 6000 and "added_tokens_decoder" not in tok.init_kwargs
    assert tok.added_tokens_decoder == ref.added_tokens_decoder  # read from the Rust tokenizer
    texts = ["The capital of France is", "  spaces\tand\nnewlines  ", "<start_of_turn>user\nHi",
             "naïve café 東京 🙂", "def f(x):\n    return x**2"]
    for t in texts:
        ids = tok(t)["input_ids"]
        assert ids == ref(t)["input_ids"]
        assert tok.decode(ids) == ref.decode(ids)
    assert tok.get_vocab() == ref.get_vocab()
