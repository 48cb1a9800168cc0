"""`flatserve generate | chat | serve`: flags named as vLLM names them."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from flatserve.config import EngineConfig, parse_size


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="model_flag", default=None,
                   help="HF directory or .gguf file (default: the embedded Gemma 3 270M)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | mps")
    p.add_argument("--attention-backend", default=None, help="torch | triton")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="e.g. 4GiB")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--os-reserve-gb", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=True)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="Jinja file overriding the model's")


def engine_config(a: argparse.Namespace, positional_model: str | None = None) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=positional_model or a.model_flag, dtype=a.dtype, device=a.device,
        attention_backend=a.attention_backend, block_size=a.block_size,
        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=a.kv_cache_memory,
        num_gpu_blocks_override=a.num_gpu_blocks_override, os_reserve_gb=a.os_reserve_gb,
        gpu_memory_utilization=a.gpu_memory_utilization,
        enable_prefix_caching=a.enable_prefix_caching, enforce_eager=a.enforce_eager,
        seed=a.seed, chat_template=a.chat_template,
        served_model_name=getattr(a, "served_model_name", None))


def _sampling(a: argparse.Namespace) -> Any:
    from flatserve.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, seed=a.sampling_seed)


def cmd_generate(a: argparse.Namespace) -> int:
    from flatserve.engine.llm import LLM

    params = _sampling(a)  # validate flags before the model loads
    llm = LLM.from_config(engine_config(a))
    outs = (llm.chat([{"role": "user", "content": p} for p in a.prompt][:1], params, use_tqdm=False)
            if a.command == "chat" else llm.generate(a.prompt, params, use_tqdm=False))
    for o in outs:
        print(o.outputs[0].text if a.command == "chat" else (o.prompt or "") + o.outputs[0].text)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from flatserve.server.app import run_server

    return run_server(engine_config(a, a.model), a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flatserve")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("generate", "chat"):
        g = sub.add_parser(name, help=f"{name} offline and print the result")
        add_engine_args(g)
        g.add_argument("--prompt", action="append", required=True)
        g.add_argument("--max-tokens", type=int, default=64)
        g.add_argument("--temperature", type=float, default=0.0)
        g.add_argument("--top-p", type=float, default=1.0)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--sampling-seed", type=int, default=None)
        g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", default=None)
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("FLATSERVE_API_KEY"))
    s.add_argument("--served-model-name", default=None)
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except ValueError as e:  # bad input, or the memory budget's refusal: one paragraph, no traceback
        print(f"flatserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
