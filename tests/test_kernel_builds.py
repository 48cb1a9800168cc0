"""The C++ kernels' builds (flatserve/kernels.py): explicit per-level flags, the level picked from
the CPU and forced down by FLATSERVE_CPU_ISA, one on-disk cache keyed by source and flags, a
failed build remembered (never retried at each start), and concurrent first starts building once.
CPU only: nothing here touches a GPU."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flatserve import device as dev
from flatserve import kernels


def test_level_flags_are_explicit_and_nested() -> None:
    """No -march=native anywhere; each x86 level's flags contain the level's below it (avxvnni
    is avx2's plus AVX-VNNI, which avx512 and amx lack: Zen 4 has no AVX-VNNI); portable is the
    x86-64 baseline, and off x86 no flags at all (aarch64 builds it)."""
    flags = {lv: kernels.level_flags(lv, x86=True) for lv in kernels.LEVELS}
    assert not any("native" in f for fl in flags.values() for f in fl)
    assert flags["portable"] == ["-march=x86-64"]
    assert {"-mavx2", "-mfma", "-mf16c", "-mbmi2"} <= set(flags["avx2"])
    assert {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni"} <= set(flags["avx512"])
    assert {"-mamx-tile", "-mamx-bf16", "-mamx-int8"} <= set(flags["amx"])
    for lo, hi in [("portable", "avx2"), ("avx2", "avxvnni"), ("avx2", "avx512"), ("avx512", "amx")]:
        assert set(flags[lo]) < set(flags[hi])
    assert set(flags["avxvnni"]) - set(flags["avx2"]) == {"-mavxvnni"}
    assert "-mavxvnni" not in flags["avx512"] + flags["amx"]
    assert kernels.level_flags("portable", x86=False) == []
    with pytest.raises(ValueError, match="unknown ISA level"):
        kernels.level_flags("sse9")


def test_the_level_is_the_best_the_cpu_runs_and_can_only_be_forced_down(monkeypatch) -> None:
    monkeypatch.setattr(dev, "cpu_isa_levels", lambda: ("avx2", "portable"))
    monkeypatch.delenv("FLATSERVE_CPU_ISA", raising=False)
    assert dev.cpu_isa() == "avx2"
    monkeypatch.setenv("FLATSERVE_CPU_ISA", "portable")
    assert dev.cpu_isa() == "portable"
    monkeypatch.setenv("FLATSERVE_CPU_ISA", "amx")
    with pytest.raises(ValueError, match="this CPU runs only avx2, portable"):
        dev.cpu_isa()
    monkeypatch.setenv("FLATSERVE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="choose one of auto, amx, avx512, avxvnni, avx2, portable"):
        dev.cpu_isa()


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 levels only")
def test_the_avx512_level_needs_vnni(monkeypatch) -> None:
    """The avx512 level's kernels use VNNI byte dots (csrc/quant_rows.h): a CPU with AVX-512 BF16
    but no AVX512_VNNI flag runs avx2 at best."""
    flags = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
             "avx512_bf16"}
    monkeypatch.setattr(dev, "_cpu_flags", lambda: frozenset(flags))
    dev.cpu_isa_levels.cache_clear()
    try:
        assert dev.cpu_isa_levels() == ("avx2", "portable")
        flags.add("avx512_vnni")
        dev.cpu_isa_levels.cache_clear()
        assert dev.cpu_isa_levels() == ("avx512", "avx2", "portable")  # Zen 4: no AVX-VNNI
        flags.add("avx_vnni")
        dev.cpu_isa_levels.cache_clear()
        assert dev.cpu_isa_levels() == ("avx512", "avxvnni", "avx2", "portable")  # Zen 5
        flags.difference_update({"avx512f", "avx512_vnni"})
        dev.cpu_isa_levels.cache_clear()
        assert dev.cpu_isa_levels() == ("avxvnni", "avx2", "portable")  # Alder Lake
    finally:
        monkeypatch.undo()
        dev.cpu_isa_levels.cache_clear()


def test_a_kernel_with_no_avxvnni_build_runs_its_avx2_one(monkeypatch) -> None:
    """At avxvnni only the kernels listing it build there (the quantized linears); the others
    load their avx2 build, and a kernel with no avx2 build (AMX only) has none."""
    from flatserve.attention import cpu_backend
    from flatserve.model import amx, quant

    monkeypatch.setattr(dev, "cpu_isa", lambda: "avxvnni")
    assert quant._ext.level() == "avxvnni" and quant._ext.name.endswith("_avxvnni")
    assert cpu_backend.kernel.level() == "avx2" and cpu_backend.kernel.name.endswith("_avx2")
    assert amx._ext.level() is None
    assert ("flatserve_paged_decode_cpu", "avxvnni") not in kernels.jobs(["avxvnni", "avx2"])
    assert ("flatserve_quant_gemm_cpu", "avxvnni") in kernels.jobs(["avxvnni", "avx2"])


def test_this_cpus_levels_follow_its_flags() -> None:
    """The detected levels are nested (a CPU that runs one runs every level below it, but
    avxvnni, which only CPUs with AVX-VNNI run) and always end with portable; where /proc/cpuinfo
    lists AVX2's flags, avx2 is among them."""
    levels = dev.cpu_isa_levels()
    assert levels[-1] == "portable"
    assert list(levels) == [lv for lv in dev.ISA_LEVELS if lv in levels]
    order = [lv for lv in dev.ISA_LEVELS if lv != "avxvnni" or "avx_vnni" in dev._cpu_flags()]
    assert order[order.index(levels[0]):] == list(levels)
    if {"avx2", "fma", "f16c", "bmi2"} <= dev._cpu_flags():
        assert "avx2" in levels


def test_the_device_module_imports_no_kernel_module() -> None:
    """Hardware detection imports nothing that imports it back (no cycles)."""
    out = subprocess.run([sys.executable, "-c", "import sys, flatserve.device; print(' '.join("
                          "m for m in sys.modules if m.startswith('flatserve')))"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in out if m.split(".")[1:2] in (["attention"], ["ops"], ["model"], ["kernels"])], out


def test_the_cache_key_follows_source_and_level(tmp_path) -> None:
    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    a = kernels.Build("flatserve_test_key", src, "portable")
    assert kernels.Build("flatserve_test_key", src, "portable").dir == a.dir
    if "avx2" in dev.cpu_isa_levels():
        assert kernels.Build("flatserve_test_key", src, "avx2").dir != a.dir
    src.write_text("int f() { return 2; }\n")
    assert kernels.Build("flatserve_test_key", src, "portable").dir != a.dir



def test_the_cache_key_follows_the_headers_a_source_includes_and_no_other(tmp_path, monkeypatch) -> None:
    """A header's edit changes the key of the sources that include it (directly or through
    another header), and of no other source."""
    from flatserve import kernel_build

    hdr = tmp_path / "csrc"
    hdr.mkdir()
    (hdr / "a.h").write_text('#pragma once\n#include "b.h"\n')
    (hdr / "b.h").write_text("#pragma once\nint b();\n")
    (hdr / "c.h").write_text("#pragma once\nint c();\n")
    monkeypatch.setattr(kernel_build, "_HEADERS", hdr)
    uses_a, uses_c = tmp_path / "x.cpp", tmp_path / "y.cpp"
    uses_a.write_text('#include "a.h"\n#include <vector>\nint f() { return b(); }\n')
    uses_c.write_text('#  include "c.h"\nint g() { return c(); }\n')
    assert kernel_build.shared_headers(uses_a) == [hdr / "a.h", hdr / "b.h"]
    assert kernel_build.shared_headers(uses_c) == [hdr / "c.h"]
    key = lambda s: kernels.Build("flatserve_test_key", s, "portable").dir  # noqa: E731
    a0, c0 = key(uses_a), key(uses_c)
    (hdr / "b.h").write_text("#pragma once\nint b(); // edited\n")
    assert key(uses_a) != a0 and key(uses_c) == c0
    (hdr / "c.h").write_text("#pragma once\nint c(); // edited\n")
    assert key(uses_c) != c0

def test_a_failed_build_is_remembered_and_reported_once(tmp_path, monkeypatch, caplog) -> None:
    """What every C++ path's fallback hangs on: the kernel is None with its reason, logged once;
    the next start (a new CpuKernel) reads the failure from disk instead of compiling again."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    src = tmp_path / "broken.cpp"
    src.write_text("#include <pybind11/pybind11.h>\nthis is not C++;\n")
    k = kernels.CpuKernel("flatserve_test_broken", src, "the test's fallback runs", level_free=True)
    with caplog.at_level("WARNING"):
        assert k() is None and k() is None  # built (and failed) once
    assert k.error and [r.getMessage() for r in caplog.records].count(
        f"flatserve_test_broken_portable unavailable ({k.error}); the test's fallback runs") == 1
    b = k.build_for("portable")
    assert "error" in (b.failure() or "") and (b.dir / "build.log").exists()

    def no_compile(self) -> None:
        raise AssertionError("a remembered failure was compiled again")

    monkeypatch.setattr(kernels.Build, "_compile", no_compile)
    again = kernels.CpuKernel("flatserve_test_broken", src, "the test's fallback runs", level_free=True)
    t0 = time.time()
    assert again() is None and "build failed earlier" in again.error and "--retry" in again.error
    assert time.time() - t0 < 5


_RACE_SRC = """
#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

_RACE_CHILD = """
import sys
from flatserve import kernels
k = kernels.CpuKernel("flatserve_test_race", sys.argv[1], "none", level_free=True)
b = k.build_for("portable")
compiled = b.build()
print(compiled, b.load().add(2, 3))
"""


def test_concurrent_first_starts_build_once(tmp_path) -> None:
    """Two processes on an empty cache (two servers, two xdist workers): one compiles under the
    file lock, the other waits and loads its build; neither sees a half-written module."""
    import os

    src = tmp_path / "race.cpp"
    src.write_text(textwrap.dedent(_RACE_SRC))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE_CHILD, str(src)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    lines = sorted(o[0].split()[-2] + " " + o[0].split()[-1] for o in outs)
    assert lines == ["False 5", "True 5"], lines
    assert len(list(Path(tmp_path / "cache" / "flatserve").glob("flatserve_test_race_portable-*/OK"))) == 1
