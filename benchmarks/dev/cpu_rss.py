"""Where a CPU engine's resident memory goes: peak RSS (VmHWM) and a /proc/self/smaps breakdown
(weights files, heap, anonymous mappings, libraries) after start-up and after a run of N
concurrent prompts, in this process (one engine per invocation).

    .venv/bin/python benchmarks/dev/cpu_rss.py [--dequantize] [--[no-]greedy-int8-head]
        [--seqs 16] [--prompt-len 256] [--max-tokens 64] [--libs 8]

The engine is the server's (benchmarks/vs_llamacpp_cpu.py): --max-model-len 2048,
--max-num-seqs N, prefix caching off. Runtime: ~1-2 min on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import time

sys.path.insert(0, ".")


def vm(key: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def smaps() -> dict[str, int]:
    """Resident bytes per mapping name: [heap], [anon] for nameless ones, else the file."""
    out: dict[str, int] = collections.Counter()
    name = ""
    for line in open("/proc/self/smaps"):
        head = line.split()
        if not head:
            continue
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            name = head[5] if len(head) > 5 else "[anon]"
        elif head[0] == "Rss:":
            out[name] += int(head[1]) * 1024
    return out


def anon_sizes(top: int) -> list[tuple[int, int]]:
    """The `top` largest nameless mappings: (resident bytes, mapping size)."""
    rows, size = [], 0
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            size = hi - lo if len(head) <= 5 else -1
        elif head and head[0] == "Rss:" and size >= 0:
            rows.append((int(head[1]) * 1024, size))
    return sorted(rows, reverse=True)[:top]


def groups(m: dict[str, int]) -> dict[str, int]:
    g: dict[str, int] = collections.Counter()
    for name, b in m.items():
        if name in ("[heap]", "[anon]"):
            g[name] += b
        elif ".so" in name:
            g["libraries"] += b
        elif "/.cache/flatserve" in name or name.endswith((".gguf", ".bin", ".safetensors")):
            g["weights files"] += b
        else:
            g["other " + name if name.startswith("[") else "other files"] += b
    return g


def report(tag: str, libs: int) -> None:
    m = smaps()
    mb = lambda b: f"{b / 2**20:7.1f}"  # noqa: E731
    print(f"== {tag}: VmRSS {mb(vm('VmRSS'))} MiB, VmHWM {mb(vm('VmHWM'))} MiB")
    for k, b in sorted(groups(m).items(), key=lambda kv: -kv[1]):
        print(f"   {k:24s} {mb(b)} MiB")
    top = sorted(((b, n) for n, b in m.items() if ".so" in n), reverse=True)[:libs]
    print("   largest libraries: " + ", ".join(f"{n.rsplit('/', 1)[-1]} {b / 2**20:.1f}" for b, n in top))
    print("   largest anonymous mappings (resident/size MiB): " + ", ".join(
        f"{r / 2**20:.0f}/{z / 2**20:.0f}" for r, z in anon_sizes(libs)))
    print(f"   triton imported: {'triton' in sys.modules}, torch._dynamo: {'torch._dynamo' in sys.modules}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dequantize", action="store_true")
    ap.add_argument("--greedy-int8-head", action=argparse.BooleanOptionalAction, default=None,
                    help="the 7-bit greedy copy of a bf16 LM head (default: the engine's choice)")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--libs", type=int, default=8)
    a = ap.parse_args()
    from flatserve import LLM, SamplingParams

    report("imported flatserve", a.libs)
    t = time.perf_counter()
    llm = LLM(device="cpu", max_num_seqs=a.seqs, max_model_len=2048, enable_prefix_caching=False,
              dequantize=a.dequantize, greedy_int8_head=a.greedy_int8_head)
    report(f"started ({time.perf_counter() - t:.0f} s)", a.libs)
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: the run's peak alone
    rng = random.Random(0)
    vocab = llm.engine.state.model.vocab_size
    prompts = [[rng.randrange(100, min(vocab, 200_000)) for _ in range(a.prompt_len)] for _ in range(a.seqs)]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    report(f"{a.seqs} x {a.prompt_len} prompt tokens x {a.max_tokens} out ({time.perf_counter() - t:.0f} s)",
           a.libs)


if __name__ == "__main__":
    main()
