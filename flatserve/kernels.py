"""Which C++ CPU kernels the engine has, what runs where, and the kernels' CLI:
`python -m flatserve.kernels build|check|status` (scripts/setup.sh runs `build`). The build
machinery (ISA levels, flags, the on-disk cache, `CpuKernel`) is flatserve/kernel_build.py;
the kernel modules import that, and this module imports them: one direction."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from flatserve import device as dev
# Re-exported: tests and benchmarks/common.py reach the build machinery through this module.
from flatserve.kernel_build import LEVELS, Build, CpuKernel, build_module, compile_check, level_flags  # noqa: F401


def registry() -> list[CpuKernel]:
    """Every kernel the engine uses (importing their modules registers nothing else)."""
    from flatserve.attention import cpu_backend
    from flatserve.model import amx, avx2, cpu_stack, quant
    from flatserve.ops import cpu_ops

    return [cpu_backend.kernel, cpu_backend.prompt_kernel, cpu_backend.prefill_kernel,
            cpu_ops.module, amx._ext, cpu_stack._ext, avx2._ext, quant._ext]


def default_backend(device: object) -> str:
    """Triton on CUDA; on the CPU the C++ decode kernel where it built at this run's ISA level
    (flatserve/kernels.py: built by scripts/setup.sh, else on first use); torch else."""
    kind = getattr(device, "type", device)
    if kind == "cuda":
        return "triton"
    if kind == "cpu":
        from flatserve.attention import cpu_backend

        return "cpu" if cpu_backend.available() else "torch"
    return "torch"


def row_argmax(x: "torch.Tensor") -> "torch.Tensor":  # noqa: F821 - torch imported by callers
    """x [R, V] -> int64 [R] with x.max(dim=-1).indices' rule. On the CPU through the fused
    ops' vector kernel where it built (16 x 262k bf16: see flatserve/ops/cpu_ops.py); elsewhere
    torch's reduction."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0:
        from flatserve.ops import cpu_ops

        if cpu_ops.available():
            return cpu_ops.argmax_rows(x)
    return x.max(dim=-1).indices


def _build_one(stem: str, level: str) -> tuple[str, str | None]:
    """Worker process: one kernel at one level -> (module name, error or None)."""
    k = next(k for k in registry() if k.stem == stem)
    b = k.build_for(level)
    try:
        b.build()
        return b.name, None
    except Exception as e:  # noqa: BLE001
        return b.name, str(e)


def jobs(levels: list[str]) -> list[tuple[str, str]]:
    """(kernel stem, level) for every build serving these levels."""
    out: list[tuple[str, str]] = []
    for k in registry():
        for lv in ("portable",) if k.level_free else [x for x in levels if x in k.levels]:
            if (k.stem, lv) not in out:
                out.append((k.stem, lv))
    return out


def main(argv: list[str] | None = None) -> int:
    """`build`: every kernel at every level this CPU runs (or --levels), in parallel processes;
    `check`: compile objects only, at any level (AMX objects compile on an AVX2 machine)."""
    import argparse
    from concurrent.futures import ProcessPoolExecutor

    ap = argparse.ArgumentParser(prog="python -m flatserve.kernels")
    ap.add_argument("action", choices=("build", "check", "status"))
    ap.add_argument("--levels", default=None, help="comma-separated; default: those this CPU runs")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--retry", action="store_true", help="forget remembered failures first")
    a = ap.parse_args(argv)
    levels = a.levels.split(",") if a.levels else list(dev.cpu_isa_levels())
    for lv in levels:
        level_flags(lv)  # unknown level -> ValueError
    todo = jobs(levels)
    if a.action == "status":
        for stem, lv in todo:
            b = next(k for k in registry() if k.stem == stem).build_for(lv)
            print(f"{b.name:40s} {'built' if b.built() else 'FAILED: ' + b.failure() if b.failure() else 'not built'}")
        return 0
    if a.action == "check":
        import tempfile

        with tempfile.TemporaryDirectory() as tmp, \
                ProcessPoolExecutor(max_workers=max(1, min(a.jobs, len(todo)))) as pool:
            ks = [next(k for k in registry() if k.stem == stem) for stem, _ in todo]
            errs = list(pool.map(compile_check, [k.source for k in ks],
                                 [k.name_at(lv) for k, (_, lv) in zip(ks, todo)], [lv for _, lv in todo],
                                 [Path(tmp) / f"{stem}_{lv}.o" for stem, lv in todo]))
        for k, (_, lv), err in zip(ks, todo, errs):
            print(f"{k.name_at(lv):40s} {'compiles' if err is None else 'FAILED'}")
            if err:
                print(err, file=sys.stderr)
        return 1 if any(errs) else 0
    runnable = set(dev.cpu_isa_levels())
    if not set(levels) <= runnable:
        print(f"build: this CPU runs only {', '.join(sorted(runnable))}; use `check` for others")
        return 2
    if a.retry:
        for stem, lv in todo:
            b = next(k for k in registry() if k.stem == stem).build_for(lv)
            (b.dir / "FAILED").unlink(missing_ok=True)
    with ProcessPoolExecutor(max_workers=max(1, min(a.jobs, len(todo)))) as pool:
        results = list(pool.map(_build_one, *zip(*todo)))
    for name, err in results:
        print(f"{name:40s} {'built' if err is None else 'FAILED: ' + err}")
    # A kernel that cannot build is not fatal (its fallback runs, logged at start): set-up goes on.
    return 0


if __name__ == "__main__":
    sys.exit(main())
