"""The one-row q4_0 GEMVs (flatserve/ops/csrc/q4_gemv_cuda.cu) around their PDL wait, read in the
SASS: no coherent load ahead of griddepcontrol.wait (x, which the kernel before writes: read
earlier, it races that kernel), and each kernel's first weight loads (.nc, fixed) ahead of it, so
they are in flight while the kernel before ends. ptxas treats .nc loads as invariant and may move
them across the wait: one build of q4_ks read x before it (b16e738; fixed in bb9200d).

Built for sm_90 by NVCC where the machine has one (this project's CPU machines do), else by NVRTC
through cuda_gemv on a CUDA machine; read with the cuobjdump that Triton's wheel carries. Skips
where there is no compiler or no cuobjdump."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from flatserve.model import cuda_gemv

KERNELS = ["q4_gemv_r1_u2", "q4_gemv_r2_u2", "q4_gemv_r4_u2", "q4_mma_rp2_u2", "q4_mma_rp2_u4", "q4_ks_rt8",
           "q4_ks_norm_rt8", "q4_ks_norm_silu_rt8", "q4_ks_norm_gelu_rt8", "q4_gemv_r1_u2_nout",
           "q4_gemv_r2_u2_nout", "q4_gemv_r4_u2_nout", "q4_ks_scaled_rt8", "q4_ks_scaled_silu_rt8",
           "q4_ks_scaled_gelu_rt8", "q4_ksx_rt8", "q4_ksx_nout_rt8"]
KERNELS += [k + "_h2" for k in KERNELS if not k.startswith("q4_mma")]  # the packed-fp16 forms


def _cuobjdump() -> str:
    triton = pytest.importorskip("triton")
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(path, os.X_OK):
        pytest.skip("no cuobjdump in Triton's wheel here")
    return path


def _cubin(tmp_path):
    """The source built for sm_90 -> the cubin's path."""
    out = tmp_path / "gemv.cubin"
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if os.access(nvcc, os.X_OK):
        subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-cubin", str(cuda_gemv._SRC), "-o", str(out)],
                       check=True, capture_output=True)
    elif torch.cuda.is_available() and cuda_gemv.prepare(torch.device("cuda")):
        out.write_bytes(cuda_gemv._API.compile("sm_90"))
    else:
        pytest.skip("neither NVCC nor a CUDA device with NVRTC here")
    return out


def _functions(sass: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        if "Function : " in line:
            name = line.split("Function : ")[1].strip()
            funcs[name] = []
        elif name is not None:
            funcs[name].append(line)
    return funcs


def test_no_load_of_x_ahead_of_the_pdl_wait_and_weights_before_it(tmp_path) -> None:
    cuobjdump = _cuobjdump()
    sass = subprocess.run([cuobjdump, "-sass", str(_cubin(tmp_path))], check=True, capture_output=True,
                          text=True).stdout
    funcs = _functions(sass)
    for name in KERNELS:
        lines = funcs[name]
        wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
        before = [line for line in lines[:wait] if "LDG" in line]
        coherent = [line.strip() for line in before if "CONSTANT" not in line]
        assert not coherent, f"{name}: coherent loads ahead of the PDL wait: {coherent}"
        assert before, f"{name}: no weight load ahead of the PDL wait"
        # x through coherent loads (after the wait, as checked above): .nc ones could be hoisted
        assert any("LDG" in line and "CONSTANT" not in line for line in lines[wait:]), \
            f"{name}: x not read with coherent loads"
