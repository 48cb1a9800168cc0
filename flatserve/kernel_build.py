"""The C++ CPU kernels' build machinery: one build per ISA level, picked at run time, in one
on-disk cache. (Which kernels exist and the CLI: flatserve/kernels.py, which imports the
kernel modules; they import only this module, so there is no cycle.)

Each kernel source is compiled once per ISA level with explicit flags (never -march=native),
as a module named per level (`flatserve_paged_decode_cpu_avx2`), so one cache serves any CPU
and a run can be forced down a level (`FLATSERVE_CPU_ISA`, flatserve/device.py) for tests and
A/Bs. The levels are feature sets, each a superset of the next:

  amx       AMX-BF16/INT8 tiles + AVX512-BF16 (Sapphire Rapids and later)
  avx512    AVX512F/BW/VL/DQ + AVX512-BF16 (AMD Zen 4, Cooper Lake)
  avxvnni   avx2 + AVX-VNNI (Intel Alder Lake and later client cores, AMD Zen 5): only the
            kernels that use its dot products build there (`CpuKernel(levels=...)`); the
            others run their avx2 build (device.SERVED_BY)
  avx2      AVX2 + FMA + F16C + BMI2 (x86-64 of the last decade)
  portable  no ISA flags (x86-64 baseline, or whatever the compiler targets: aarch64)

A source holds one code path per level under `#if defined(__AVX512F__)`-style guards, and its
plain C++ path where a level has none of its own. Each level's flags hold the avx2 level's; avx512
and amx do not hold avxvnni's (Zen 4 has AVX512-VNNI but not the VEX-encoded AVX-VNNI).

The cache: `<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/flatserve/<name>-<key>/`, the
key hashing the source and the shared headers it includes (`shared_headers`), the flags, the
compiler's version, torch and Python.
`scripts/setup.sh` fills it (`python -m flatserve.kernels build`); a start only imports the
built module, and builds only a source changed since (a first-use build, under a file lock so
that concurrent first starts build once and the others wait and load). A failed build is
remembered there (FAILED, with the compiler's log) and reported, never retried at each start:
`python -m flatserve.kernels build --retry` (or a new compiler: its version is in the key)
tries again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from flatserve import device as dev

log = logging.getLogger(__name__)

LEVELS = dev.ISA_LEVELS  # best first
BASE_LEVELS = tuple(lv for lv in LEVELS if lv not in dev.SERVED_BY)  # a kernel's levels by default
_HEADERS = Path(__file__).parent / "csrc"  # cpu_math.h and the other shared headers


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def level_flags(level: str, x86: bool | None = None) -> list[str]:
    """The compiler flags of one ISA level. x86 levels start from the x86-64 baseline so that a
    compiler whose default target is higher (RHEL 10 defaults to x86-64-v3) cannot leak in."""
    if level not in LEVELS:
        raise ValueError(f"unknown ISA level {level!r}; choose one of {', '.join(LEVELS)}")
    x86 = _x86() if x86 is None else x86
    if not x86:
        return []  # portable only: the compiler's own target (aarch64: NEON is baseline)
    avx2 = ["-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"]
    avx512 = avx2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"]
    extra = {"portable": [], "avx2": avx2, "avxvnni": avx2 + ["-mavxvnni"], "avx512": avx512,
             # No -mtune=sapphirerapids: with it GCC 12 compiled the decode kernel's 8-vector
             # pass to other bits than its 2-vector one (a verify row then differed from the
             # same row decoded alone, so speculation changed greedy answers); the amx level's
             # vector code is now the avx512 level's, bit for bit.
             "amx": avx512 + ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]}
    return ["-march=x86-64", *extra[level]]


# -fno-trapping-math: without it GCC keeps any loop with a float -> int conversion (the
# kernels' exp) scalar, since the conversion could raise an FP exception nobody reads here.
_COMMON = ["-O3", "-fopenmp", "-fno-trapping-math"]


@functools.cache
def compiler_id() -> str:
    """The C++ compiler torch would use and its version line ('none' where there is none)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    cxx = get_cxx_compiler()
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return f"{cxx}: {out.stdout.splitlines()[0] if out.stdout else out.returncode}"
    except (OSError, subprocess.TimeoutExpired):
        return f"{cxx}: none"


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


def shared_headers(source: Path) -> list[Path]:
    """The shared headers (csrc/*.h) `source` includes, directly or through each other, sorted:
    a source's build key covers these alone, so editing one header rebuilds only the kernels that
    include it (every header in every key made a header edit rebuild all CPU extensions at every
    level: 2-5 minutes per level on a 2-core VM before a test ran)."""
    seen: set[Path] = set()
    todo = [source]
    while todo:
        for name in _INCLUDE.findall(todo.pop().read_bytes()):
            h = _HEADERS / name.decode()
            if h.is_file() and h not in seen:
                seen.add(h)
                todo.append(h)
    return sorted(seen)


def _headers_hash(source: Path) -> str:
    parts = (h.name.encode() + b"\0" + h.read_bytes() for h in shared_headers(source))
    return hashlib.sha1(b"".join(parts)).hexdigest()


def source_flags(source: Path) -> list[str]:
    """A source's own compiler flags: its `// flatserve-cflags: ...` lines (e.g. the decode kernel's
    -ffp-contract=off: where GCC may fuse a multiply and an add it decides per compile, so two
    code paths meant to round alike need not, and a verify row's bits then differed from the same
    row decoded alone on a 16-core host's compiler)."""
    tag = "// flatserve-cflags:"
    return [f for line in source.read_text().splitlines() if line.startswith(tag)
            for f in line[len(tag):].split()]


def cache_root() -> Path:
    """TORCH_EXTENSIONS_DIR (torch's own setting, read at each call) or torch's default root."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "flatserve"


class Build:
    """One kernel source at one level: its key, folder, and what happened to it."""

    def __init__(self, name: str, source: Path, level: str) -> None:
        import torch

        self.name, self.source, self.level = name, source, level
        self.cflags = [*_COMMON, *level_flags(level), *source_flags(source),
                       f"-DFLATSERVE_HEADERS={_headers_hash(source)[:12]}"]
        h = hashlib.sha1()
        for part in (source.read_bytes(), _headers_hash(source).encode(), " ".join(self.cflags).encode(),
                     compiler_id().encode(), torch.__version__.encode(), sys.version.encode(),
                     str(bool(shutil.which("ninja"))).encode()):
            h.update(part + b"\0")
        self.dir = cache_root() / f"{name}-{h.hexdigest()[:16]}"
        self.library = self.dir / f"{name}.so"

    def failure(self) -> str | None:
        failed = self.dir / "FAILED"
        return failed.read_text().strip() if failed.exists() else None

    def built(self) -> bool:
        return (self.dir / "OK").exists() and self.library.exists()

    def load(self) -> ModuleType:
        """Import the built module (no compiler, no ninja: what every start after set-up does)."""
        if self.name in sys.modules:
            return sys.modules[self.name]
        spec = importlib.util.spec_from_file_location(self.name, self.library)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[self.name] = mod
        return mod

    def build(self) -> bool:
        """Compile and link into self.dir under a file lock; a failure is written to FAILED
        (raises RuntimeError with it). Another process holding the lock builds; this one waits
        for it and then finds the result on disk. -> whether this process compiled it."""
        import fcntl

        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if the builder dies
            if self.built():
                return False
            if (why := self.failure()) is not None:
                raise RuntimeError(why)
            (self.dir / "lock").unlink(missing_ok=True)  # torch's own baton, if a build was killed
            try:
                self._compile()
            except Exception as e:  # noqa: BLE001 - any build failure is remembered
                why = explain(e)
                (self.dir / "build.log").write_text(str(e))
                (self.dir / "FAILED").write_text(why + "\n")
                raise RuntimeError(why) from None
            (self.dir / "OK").write_text(compiler_id() + "\n")
            return True

    def _compile(self) -> None:
        import torch.utils.cpp_extension as ext

        os.environ.setdefault("MAX_JOBS", "1")  # one source per module
        ext.load(name=self.name, sources=[str(self.source)], extra_include_paths=[str(_HEADERS)],
                 extra_cflags=self.cflags, extra_ldflags=["-fopenmp"], build_directory=str(self.dir),
                 verbose=False, is_python_module=False, is_standalone=False)


def explain(e: Exception) -> str:
    """A failed build's cause in one line (the compiler's first diagnostic), and what to
    install where that is the cause."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    diag = [x for x in lines if "error:" in x.lower() and not x.startswith("[")]
    cause = (diag or [x for x in lines if "error" in x.lower() or "required" in x.lower()]
             or [repr(e)])[0][:300]
    low = cause.lower()
    hints = [("ninja", "install ninja (pip install ninja)"),
             ("python.h", "install the Python headers (apt install python3-dev)"),
             ("omp.h", "a compiler with OpenMP (GCC; Apple clang has none)"),
             ("fopenmp", "a compiler with OpenMP (GCC; Apple clang has none)"),
             ("unrecognized command-line option", "a newer compiler (GCC >= 12 knows every level's flags)"),
             ("not found", "install a C++ compiler (apt install g++)"),
             ("no such file or directory: 'c++'", "install a C++ compiler (apt install g++)")]
    hint = next((h for key, h in hints if key in low), "see build.log beside FAILED")
    return f"{cause} [{hint}]"


class CpuKernel:
    """One C++ kernel source, available at `levels` (best first). `kernel()` is the module at
    this run's ISA level (device.cpu_isa()), built or loaded on first use and kept; None where
    the kernel has no build at that level or its build failed, with the reason in `error`,
    logged once per level together with what runs instead (`fallback`).

    level_free: the source has no ISA-specific code (it calls other kernels' ops through
    torch's dispatcher), so its one portable build serves every level."""

    def __init__(self, stem: str, source: str | Path, fallback: str,
                 levels: tuple[str, ...] = BASE_LEVELS, level_free: bool = False) -> None:
        self.stem, self.source, self.fallback = stem, Path(source), fallback
        self.levels = ("portable",) if level_free else levels
        self.level_free = level_free
        self._mods: dict[str, ModuleType | None] = {}
        self._errors: dict[str, str] = {}

    def level(self, isa: str | None = None) -> str | None:
        """The build serving ISA level `isa` (this run's by default), or None where none does."""
        isa = isa or dev.cpu_isa()
        if self.level_free:
            return "portable"
        if isa not in self.levels:
            isa = dev.SERVED_BY.get(isa, isa)  # avxvnni: the avx2 build, where the kernel has none of its own
        return isa if isa in self.levels else None

    def name_at(self, level: str) -> str:
        return f"{self.stem}_{level}"

    @property
    def name(self) -> str:
        """The module name (and torch op namespace) of this run's build."""
        return self.name_at(self.level() or self.levels[0])

    @property
    def error(self) -> str | None:
        lvl = self.level()
        return self._errors.get(lvl) if lvl else f"no {self.stem} build at ISA level {dev.cpu_isa()}"

    def build_for(self, level: str) -> Build:
        return Build(self.name_at(level), self.source, level)

    def at(self, level: str) -> ModuleType | None:
        if level not in self._mods:
            self._mods[level] = self._get(level)
        return self._mods[level]

    def __call__(self) -> ModuleType | None:
        lvl = self.level()
        return self.at(lvl) if lvl else None

    def _get(self, level: str) -> ModuleType | None:
        if level not in dev.cpu_isa_levels():
            self._errors[level] = f"this CPU cannot run ISA level {level}"
            return None
        b = self.build_for(level)
        try:
            if not b.built():
                if (why := b.failure()) is not None:
                    raise RuntimeError(f"{why} (build failed earlier: {b.dir}/build.log; "
                                       f"`python -m flatserve.kernels build --retry` tries again)")
                b.build()
            return b.load()
        except Exception as e:  # noqa: BLE001 - any build or load failure means: the fallback
            self._errors[level] = str(e).splitlines()[0] if str(e) else repr(e)
            log.warning("%s unavailable (%s); %s", b.name, self._errors[level], self.fallback)
            return None


def build_module(name: str, source: str | Path, level: str | None = None) -> ModuleType:
    """One source at one ISA level (this run's by default) built into the cache and loaded;
    raises where it cannot build (the benchmarks' A/B builds of a source at a git revision)."""
    b = Build(name, Path(source), level or dev.cpu_isa())
    if not b.built():
        b.build()
    return b.load()


def compile_check(source: Path, name: str, level: str, out: Path) -> str | None:
    """Compile one source at one level to an object file only (nothing linked or loaded, so a
    level this CPU cannot run is checked too); -> the compiler's errors, or None."""
    import sysconfig

    import torch
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths

    inc = [*include_paths(), sysconfig.get_paths()["include"], str(_HEADERS)]
    b = Build(name, source, level)
    cmd = [get_cxx_compiler(), "-c", str(source), "-o", str(out), "-fPIC", "-std=c++20",
           f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in inc), *b.cflags]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr or r.stdout)[-4000:]
