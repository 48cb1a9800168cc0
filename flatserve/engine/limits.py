"""The step's size limits, sized by the device when the user leaves them unset (vLLM's rule).

`max_num_seqs` and `max_num_batched_tokens` set how much work one step may carry. On a
datacenter GPU a step of 64 sequences leaves most of the chip idle: on an H100
(`benchmarks/offline_gpu.py --shape qwen3-0.6b`, 500 x 512/128, 2026-11-24) 64 / 2,048 gave
12,035 out tok/s and 512 / 32,768 gave 22,436. A CPU is the other way round: its decode step is
memory-bound at 16-64 rows and a 2,048-token prompt chunk already takes ~0.25 s on 2 cores
(docs/performance-cpu.md), so larger steps only raise the time to first token. Flags override.
"""
from __future__ import annotations

from dataclasses import dataclass

from flatserve.memory import GiB

CPU_SEQS, CPU_TOKENS = 64, 2048  # measured right on CPUs (docs/performance-cpu.md)
# Where bf16 matmuls are emulated (no AMX / AVX512-BF16: the avx2 and portable levels) prompt rows
# run fp32 GEMMs on weights widened per call, and a 2,048-token chunk's transients (the widened
# weight, fp32 activations, 2,048 x 4,096 fp32 gate_up outputs) stayed in the heap: with the AVX2
# kernels forced on a 2-core AMX VM, bf16 weights, 16 streams served, peak RSS 1.31 / 1.37 GiB at
# 2,048 and 1.25 / 1.27 at 512, out tok/s 54.8 / 49.0 vs 45.5 / 52.6 (two alternated rounds,
# within their spread; 2026-11-27); the default GGUF, same set-up: 0.89 vs 1.00-1.03 GiB, 47.3 /
# 50.2 vs 52.6 / 49.6 tok/s, TTFT p50 5.1-5.3 vs 6.8-7.3 s. llama.cpp's prompt micro-batch is 512.
# A GGUF's quantized linears there take int16 codes on prompt rows too since 2026-11-28
# (model/quant.py, PROMPT_INT16_LEVELS): no widened weight. Re-measured for them on a 2-core Zen 5,
# the default GGUF served at 16 streams, flatserve alone, two alternated runs each (2026-11-28):
# kernels at avxvnni 512 / 1,024 / 2,048 -> 182.0, 181.3 / 193.5, 187.9 / 190.8, 194.2 out tok/s
# (peak RSS 0.86 / 0.88 / 0.90-0.92 GiB against llama-server's 0.83), then 1,024 against
# llama-server in a later run 1.92x / 1.95x where 512 read 1.96x / 1.93x; at avx2 512 / 1,024 ->
# 161.1, 170.4 / 166.9, 166.2. No gain that outlasts the VM's drift: 512 stays.
# (docs/performance-cpu.md, AVX2 section.)
CPU_TOKENS_EMULATED_BF16 = 512
# AVX512-BF16 without AMX (AMD Zen 4): 512 as well. There the served default GGUF keeps its greedy
# head's 4-bit copy (model/greedy_q8.py, 94 MB), and with 2,048-token chunks' transients the
# 16-stream peak RSS read 0.95 GiB against llama-server's 0.83 (issue #30's bar: +10%). On a
# 2-core Zen 4, 16 streams of 256 + 64 tokens (`benchmarks/vs_llamacpp_cpu.py`, 2026-11-28):
# 2,048 -> 151.3 out tok/s, TTFT p50 2.46 s, 0.95 GiB (one run); 1,024 -> 154.5-183.8, 2.08-2.68
# s, 0.886-0.906 GiB (four runs, the last 1.0996x llama-server's); 512 -> 127.9-170.7, 0.87-0.88
# GiB (three runs). flatserve alone, alternated: 2,048 -> 160.6 / 160.8 tok/s at 0.94 GiB, 512 ->
# 161.3 / 155.5 at 0.88. Long prompts lose up to ~10%: four 2,000-token prompts
# (`benchmarks/dev/cpu_prompt_chunks.py T`, alternated, two sittings) 1,006 / 987 / 987 / 1,066
# prompt tok/s at 2,048, 992 / 885 / 965 at 1,024, 1,004 / 1,014 / 920 / 943 at 512. With AMX
# (tiles) 2,048 stays: not re-measured. Again on a 2-core Zen 4 after the tokenizer's 39 MB
# (9a838dc, 2026-11-29; alternated, each against llama-server in the same run; raw
# docs/benchmarks/raw/cpu_zen4_step_tokens_1024_vs_512_9a838dc/): 1,024 -> 187.9 / 177.2 out
# tok/s (1.93x / 1.99x) at 0.86-0.87 GiB, 512 -> 180.1 / 177.8 (1.85x / 1.94x) at 0.85, with
# llama-server at 0.79 GiB: within the noise, and 1,024 at the RSS bar. 512 stays.
CPU_TOKENS_NO_AMX = 512
# (device memory at least, sequences, batched tokens): the GPU tiers. 60 GiB covers the
# H100/H200/A100-80G class; 20 GiB the 24-48 GiB cards (L4, A10, RTX 4090, L40S).
GPU_TIERS = ((60 * GiB, 512, 32768), (20 * GiB, 256, 16384), (0, 128, 8192))
ACTIVATION_SHARE = 0.1  # a step's activations may take at most this share of device memory


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    why: str  # for the start-up line

    def line(self) -> str:
        return f"step limits: {self.max_num_seqs} sequences, {self.max_num_batched_tokens} " \
               f"batched tokens ({self.why})"


def size_limits(seqs: int | None, tokens: int | None, device_type: str, total_memory: int,
                hidden: int, intermediate: int, elt: int, fast_bf16: bool = True,
                amx: bool = True) -> StepLimits:
    """The user's values where set; else by device: on a CPU without fast bf16 (`fast_bf16`
    False) or without AMX tiles (`amx` False) the smaller token budget (for the reasons above);
    the GPU tier of `total_memory`, with the
    token budget halved until one step's activations (~hidden x 6 + intermediate x 3 values a
    token: residual, norms, q/k/v/o, gate/up/act) fit ACTIVATION_SHARE of the memory."""
    if device_type == "cpu" and not fast_bf16:
        return _fill(seqs, tokens, CPU_SEQS, CPU_TOKENS_EMULATED_BF16, "CPU defaults, no native bf16")
    if device_type == "cpu" and not amx:
        return _fill(seqs, tokens, CPU_SEQS, CPU_TOKENS_NO_AMX, "CPU defaults, no AMX")
    if device_type != "cuda":
        why = "CPU defaults" if device_type == "cpu" else f"{device_type} defaults"
        return _fill(seqs, tokens, CPU_SEQS, CPU_TOKENS, why)
    gib = total_memory / GiB
    _, d_seqs, d_tokens = next(t for t in GPU_TIERS if total_memory >= t[0])
    per_token = (6 * hidden + 3 * intermediate) * elt
    while d_tokens > 2048 and d_tokens * per_token > ACTIVATION_SHARE * total_memory:
        d_tokens //= 2
    d_tokens = max(d_tokens, d_seqs)  # a decode step of every sequence must fit one step
    return _fill(seqs, tokens, d_seqs, d_tokens, f"sized for {gib:.0f} GiB of device memory")


def _fill(seqs: int | None, tokens: int | None, d_seqs: int, d_tokens: int, why: str) -> StepLimits:
    if seqs is not None and tokens is not None:
        return StepLimits(seqs, tokens, "as given")
    if seqs is not None or tokens is not None:
        why += "; the other as given"
    return StepLimits(seqs if seqs is not None else d_seqs,
                      tokens if tokens is not None else d_tokens, why)
