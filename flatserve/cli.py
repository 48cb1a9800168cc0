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
    p.add_argument("--attention-backend", default=None, help="cpu | cpu-sdpa | torch | triton (default: triton on "
                   "CUDA, cpu on CPU where its kernel builds, else torch; cpu-sdpa keeps prefill "
                   "chunks on torch SDPA instead of the AMX prefill kernel)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: sized by the device (64 on CPUs, up to 512 on GPUs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: sized by the device (2,048 on CPUs, up to 32,768 on GPUs)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="e.g. 4GiB")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--os-reserve-gb", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=True)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the decoder layers from Python every step (no CUDA graphs, no CPU decoder stack)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA)")
    p.add_argument("--quantization", choices=["q8_0", "q4_0", "int8"], default=None,
                   help="float checkpoints: keep the weights in a GGUF block format (int8 = q8_0; "
                        "a quarter / an eighth of fp32's bytes)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights from the model's config.json alone (speed runs; "
                        "its answers mean nothing)")
    p.add_argument("--dequantize", action="store_true",
                   help="GGUF: dequantize every tensor to --dtype at load (default: the stored "
                        "block formats are served in place)")
    p.add_argument("--cpu-gemm", choices=["auto", "amx", "onednn", "avx2", "torch"], default="auto",
                   help="CPU bf16 linears: our AMX kernel, oneDNN pre-packed weights, our AVX2 "
                        "kernel (bf16 widened in registers), or plain torch (auto: the first "
                        "that runs here)")
    p.add_argument("--copy-tied-lm-head", action="store_true",
                   help="with the AMX linears: pack a copy of an LM head tied to the embedding "
                        "(faster decode, +335 MB for the default model) instead of reading the "
                        "embedding table in place")
    p.add_argument("--greedy-int8-head", action=argparse.BooleanOptionalAction, default=None,
                   help="with the AMX or AVX2 linears: greedy rows find their argmax through a one-byte "
                        "(7-bit) copy of the LM head with exact bounds (same tokens; +171 MB for "
                        "the default model). Default: on with the AVX2 linears, off with AMX")
    p.add_argument("--fused-ops", default="auto",
                   help="auto | none | comma list of rmsnorm,rope,act (Triton on CUDA, C++ on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="Jinja file overriding the model's")
    p.add_argument("--speculative-method", choices=["ngram", "draft"], default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--speculative-model", default=None, help="draft model (same tokenizer)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    d = p.add_argument_group("more than one device (torchrun-style names for multi-host)")
    d.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is split over (NCCL on CUDA, gloo on the CPU)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind one server (serve only)")
    d.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks span")
    d.add_argument("--node-rank", type=int, default=0, help="this host's index; node 0 serves")
    d.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (rendezvous)")
    d.add_argument("--master-port", type=int, default=0, help="node 0's rendezvous port (0: free)")
    d.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds every rank has to join the rendezvous")


def engine_config(a: argparse.Namespace, positional_model: str | None = None) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=positional_model or a.model_flag, dtype=a.dtype, device=a.device,
        attention_backend=a.attention_backend, block_size=a.block_size,
        max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=a.kv_cache_memory,
        num_gpu_blocks_override=a.num_gpu_blocks_override, os_reserve_gb=a.os_reserve_gb,
        gpu_memory_utilization=a.gpu_memory_utilization,
        enable_prefix_caching=a.enable_prefix_caching, enforce_eager=a.enforce_eager,
        fused_ops=a.fused_ops, quantization=a.quantization, dequantize=a.dequantize, load_format=a.load_format, cpu_gemm=a.cpu_gemm,
        copy_tied_lm_head=a.copy_tied_lm_head, greedy_int8_head=a.greedy_int8_head,
        async_scheduling=a.async_scheduling, seed=a.seed, chat_template=a.chat_template,
        speculative_method=a.speculative_method,
        num_speculative_tokens=a.num_speculative_tokens, speculative_model=a.speculative_model,
        prompt_lookup_min=a.prompt_lookup_min, prompt_lookup_max=a.prompt_lookup_max,
        served_model_name=getattr(a, "served_model_name", None),
        tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
        nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr,
        master_port=a.master_port, dist_timeout_s=a.dist_timeout)


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
    cfg = engine_config(a, a.model)
    if cfg.node_rank > 0:  # another host of a multi-node group: only its ranks, no server
        from flatserve.distributed.executor import run_node

        return run_node(cfg)
    from flatserve.server.app import run_server

    return run_server(cfg, a)


def _bench_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    from flatserve.model.loader import gguf_sidecar, resolve_model

    src = resolve_model(path)
    return AutoTokenizer.from_pretrained(str(gguf_sidecar(src.path) if src.is_gguf else src.path))


def cmd_bench(a: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from flatserve.bench import datasets, plots

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.bench_cmd == "plot":
        runs = [json.loads(Path(f).read_text()) for f in a.runs]
        for p in plots.plot_runs(runs, out):
            print(p)
        return 0
    extra = json.loads(a.extra_body) if a.extra_body else {}
    tok = _bench_tokenizer(a.tokenizer)
    if a.bench_cmd == "cliff":
        from flatserve.bench.cliff import cliff

        res = cliff(tok, a.base_url, a.model, [int(x) for x in a.lengths.split(",")], a.max_tokens,
                    a.api_key, a.server_pid, True, extra)
        (out / f"cliff-{a.label or a.model}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res))
        return 0
    from flatserve.bench.serve import bench, markdown

    items = datasets.build(a.dataset, tok, a.num_prompts, a.max_tokens, a.input_len, a.seed)

    def per_level(k: int) -> list[datasets.Item]:  # fresh prompts per level (no cross-level cache hits)
        return items if k == 0 else datasets.build(a.dataset, tok, a.num_prompts, a.max_tokens,
                                                   a.input_len, a.seed + 1000 * k)

    res = bench(per_level, [int(c) for c in a.concurrency.split(",")], a.base_url, a.model, a.endpoint,
                a.api_key, a.server_pid, a.ignore_eos or a.dataset == "random", extra, not a.no_progress)
    res.update(label=a.label or a.model, dataset=a.dataset, num_prompts=len(items),
               input_tokens=[it.prompt_tokens for it in items], extra_body=extra)
    name = f"{a.label or a.model}-{a.dataset}".replace("/", "_")
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(markdown(res) + "\n")
    if not a.no_plots:
        plots.plot_runs([res], out / name)
    print(markdown(res))
    return 0


def _add_bench(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmark any OpenAI-compatible server")
    bs = b.add_subparsers(dest="bench_cmd", required=True)
    for name in ("serve", "cliff"):
        p = bs.add_parser(name)
        p.add_argument("--base-url", required=True)
        p.add_argument("--model", required=True)
        p.add_argument("--api-key", default=None)
        p.add_argument("--server-pid", type=int, default=None)
        p.add_argument("--out", default="bench_out")
        p.add_argument("--tokenizer", default=None, help="HF dir or .gguf for exact token counts")
        p.add_argument("--label", default=None)
        p.add_argument("--extra-body", default=None, help='JSON merged into each request, e.g. \'{"cache_prompt": false}\'')
        p.add_argument("--max-tokens", type=int, default=256 if name == "serve" else 64)
        p.set_defaults(func=cmd_bench)
    s = bs.choices["serve"]
    s.add_argument("--dataset", choices=["chat", "agent", "random"], default="chat")
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--input-len", type=int, default=None)
    s.add_argument("--concurrency", default="1,8,16")
    s.add_argument("--endpoint", default="v1/completions")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--no-plots", action="store_true",
                   help="only the .json and .md (`flatserve bench plot RUN.json` draws them later)")
    bs.choices["cliff"].add_argument("--lengths", default="3000,500,10")
    pl = bs.add_parser("plot")
    pl.add_argument("runs", nargs="+")
    pl.add_argument("--out", default="bench_out/plots")
    pl.set_defaults(func=cmd_bench)


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
    s.add_argument("--api-key", default=os.environ.get("FLATSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health; prefer "
                        "the FLATSERVE_API_KEY environment variable, which (unlike a flag) other "
                        "users cannot read in the process list")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may run on before they "
                        "end with finish_reason 'abort' (new ones get 503 meanwhile)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--no-ui", action="store_true", help="do not serve the chat page at /")
    s.set_defaults(func=cmd_serve)
    _add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the tables
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
