"""The one-row q4_0 GEMV in CUDA C++ (flatserve/ops/csrc/q4_gemv_cuda.cu), built at run time by
NVRTC and launched through the CUDA driver API, both through ctypes: no compiler, no toolkit and
no package beyond what a CUDA build of torch already installs (its nvidia-cuda-nvrtc wheel, the
driver's libcuda). Where either is missing, the build fails or the GPU is older than sm_80 (bf16
conversions), quant_planar.qgemm keeps the Triton FMA GEMV, after one notice. The cubin is kept
in the kernel cache, so only a first start (or a changed source) compiles.

Why: on an H100 the Triton kernel with the same arithmetic was 1.4-1.6x slower per linear
(docs/performance-gpu.md, "Quantized weights (4-bit) on the GPU"). The launch is a
cuLaunchKernelEx on torch's current stream, so CUDA graphs capture it like any kernel; `prepare`
builds and loads the module at weight load time, outside any capture. On sm_90 the launch
carries the programmatic-dependent-launch attribute (flatserve/ops/pdl.py): the kernel issues its
first weight loads before it waits for the kernel before it.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from flatserve.device import programmatic_launch

log = logging.getLogger("flatserve")
_SRC = Path(__file__).parents[1] / "ops" / "csrc" / "q4_gemv_cuda.cu"
_INCLUDED = [_SRC.parent / "q4_ks_cuda.cuh"]  # what _SRC includes (NVRTC reads it from _SRC's folder)
_MAGIC = 0x4B000000  # the bits of 2^23 (the kernel's nibble-to-float trick)
ENABLED = True  # False: qgemm keeps the Triton GEMV (the benchmark's A/B)
# The tensor-core kernel for the 4-rows-a-warp shapes ("0": the FMA kernel there, the A/B).
MMA = os.environ.get("FLATSERVE_GEMV_MMA", "1") != "0"
STEPS: int | None = None  # the mma kernel's steps a load group: None by the one-wave rule, 2 or 4 forced
FMA_ROWS: int | None = None  # the FMA kernel's rows a warp: None by fma_rows(), 1, 2 or 4 forced
# The K-split kernel (q4_ks) for K <= 4,096 from 40 x the SMs rows ("0": the kernels before it, the
# A/B); KS_ALL: at any row count (the tests).
KS = os.environ.get("FLATSERVE_GEMV_KS", "1") != "0"
KS_ALL = False
# q4_ks and the FMA kernel with their products in packed fp16 (q4_gemv_cuda.cu's H2: the `_h2`
# kernels; an H200 b1 Llama-3-8B q4_0 forward 1.85 against 2.04 ms with q4_ks's alone). "0": the
# fp32 products (the A/B); "ks": q4_ks's only (H2_ROWS False).
H2 = "" if os.environ.get("FLATSERVE_GEMV_H2", "1") == "0" else "_h2"
H2_ROWS = os.environ.get("FLATSERVE_GEMV_H2", "1") != "ks"
# q4_ks split along K over a thread block cluster (q4_gemv_cuda.cu's ksx; sm_90) for K up to
# 32,768 where q4_ks does not apply, and for the hand-off ("0": the FMA kernel there, the A/B).
KSX = os.environ.get("FLATSERVE_GEMV_KSX", "1") != "0"
KS_ROWS = 8  # rows a CTA (a CTA group with q4_ksx) of q4_ks and q4_ksx (16: b1 2.05 against 1.85 ms)
_KSX_MAX_NBLK = 8 * 128  # a portable cluster: at most 8 CTAs of 128 blocks
_MMA_SMEM_MAX = 48 * 1024  # dynamic shared memory without an opt-in: 68 bytes a block of x
_PDL_ATTR = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_CLUSTER_ATTR = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value {x, y, z}


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)),
                ("num_attrs", ctypes.c_uint)]


class _Api:
    """libnvrtc and libcuda through ctypes, and this process's loaded functions per device."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        path = _nvrtc_path()
        # NVRTC opens its builtins library by name at compile time: loaded first from the same
        # folder, it is found whatever LD_LIBRARY_PATH says (the wheels' folders are not on it).
        for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
            if ".alt." not in b:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        self.nvrtc = ctypes.CDLL(path)
        # device -> (1 | 2 | 4 rows a warp (FMA) or "mma" (2 row pairs a warp), U steps a load
        # group) -> CUfunction; and (device, kernel, shared bytes) -> resident CTAs an SM
        self.funcs: dict[int, dict[tuple[int | str, int], ctypes.c_void_p]] = {}
        self.fits: dict[tuple, int] = {}

    def check(self, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self.cuda.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def cubin(self, arch: str) -> bytes:
        """The cubin for `arch`, from the kernel cache (kernel_build.cache_root(), keyed by the
        source, the arch and NVRTC's version) or built now and stored there: later starts compile
        nothing (issue #28's rule for the CPU kernels; a build here takes ~0.2 s)."""
        from flatserve.kernel_build import cache_root

        major, minor = ctypes.c_int(), ctypes.c_int()
        self.nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        src = b"".join(f.read_bytes() for f in [_SRC, *_INCLUDED])
        key = hashlib.sha256(src + f"{arch} nvrtc {major.value}.{minor.value}".encode())
        path = cache_root() / f"q4_gemv_cuda-{key.hexdigest()[:16]}.cubin"
        try:
            return path.read_bytes()
        except OSError:
            pass
        data = self.compile(arch)
        try:  # a private name, then one rename: a concurrent start reads a whole file or none
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: built again at the next start
        return data

    def compile(self, arch: str, src: bytes | None = None) -> bytes:
        """The source (default q4_gemv_cuda.cu's) -> a cubin for `arch` (e.g. sm_90), or
        RuntimeError with NVRTC's log."""
        prog = ctypes.c_void_p()
        src = _SRC.read_bytes() if src is None else src
        if self.nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"q4_gemv_cuda.cu", 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        try:
            opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17",
                    f"--include-path={_SRC.parent}".encode()]
            rc = self.nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if rc:
                size = ctypes.c_size_t()
                self.nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value)
                self.nvrtc.nvrtcGetProgramLog(prog, buf)
                raise RuntimeError(f"NVRTC could not build {_SRC.name} for {arch}: "
                                   f"{buf.value.decode(errors='replace').strip()[-500:]}")
            size = ctypes.c_size_t()
            self.nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self.nvrtc.nvrtcGetCUBIN(prog, cubin)
            return cubin.raw
        finally:
            self.nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))

    def ctas_per_sm(self, index: int, key: tuple[int | str, int], smem: int) -> int:
        """How many 128-thread CTAs of kernel `key` (with `smem` dynamic shared bytes) an SM holds."""
        n = self.fits.get((index, key, smem))
        if n is None:
            c = ctypes.c_int()
            self.check(self.cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(c), self.funcs[index][key], 128, ctypes.c_size_t(smem)), "cuOccupancy")
            n = self.fits[(index, key, smem)] = c.value
        return n

    def load(self, index: int, cubin: bytes) -> dict[tuple[int | str, int], ctypes.c_void_p]:
        """The module into device `index`'s primary context (torch's), -> its kernels."""
        ctx = ctypes.c_void_p()
        self.check(self.cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:  # this thread has no context yet: bind the device's primary one
            dev = ctypes.c_int()
            self.check(self.cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
            self.check(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        mod, funcs = ctypes.c_void_p(), {}
        self.check(self.cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        ks = [((k, KS_ROWS), f"q4_{k.replace('_pytorch_tanh', '')}_rt{KS_ROWS}") for k in
              ("ks", "ks_norm", "ks_norm_silu", "ks_norm_gelu_pytorch_tanh", "ks_scaled", "ks_scaled_silu",
               "ks_scaled_gelu_pytorch_tanh", "ksx", "ksx_nout")]
        for key, name in [((1, 2), "q4_gemv_r1_u2"), ((2, 2), "q4_gemv_r2_u2"), ((4, 2), "q4_gemv_r4_u2"),
                          (("mma", 2), "q4_mma_rp2_u2"), (("mma", 4), "q4_mma_rp2_u4"),
                          ((1, "nout"), "q4_gemv_r1_u2_nout"), ((2, "nout"), "q4_gemv_r2_u2_nout"),
                          ((4, "nout"), "q4_gemv_r4_u2_nout")] + ks:
            for sfx in ("",) if name.startswith("q4_mma") else ("", "_h2"):
                f = ctypes.c_void_p()
                self.check(self.cuda.cuModuleGetFunction(ctypes.byref(f), mod, (name + sfx).encode()),
                           "cuModuleGetFunction")
                funcs[(*key, "h2") if sfx else key] = f
        return funcs


def _nvrtc_path() -> str:
    """libnvrtc: torch's nvidia wheel (nvidia/cu13/lib, nvidia/cuda_nvrtc/lib), else a toolkit's."""
    major = (torch.version.cuda or "0").split(".")[0]
    roots = [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    found = [f for r in roots
             for f in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib", "libnvrtc.so*")))]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    found = [f for f in found if ".alt." not in f and "builtins" not in f]
    for f in found:  # the one torch was built against first
        if f.endswith(f".so.{major}") or f".so.{major}." in f:
            return f
    if not found:
        raise OSError("no libnvrtc (torch's nvidia-cuda-nvrtc wheel or a CUDA toolkit)")
    return found[0]


_API: _Api | None = None
_FAILED: str | None = None


def prepare(device: torch.device) -> bool:
    """Build and load the kernels for `device` once (at load: not during a graph capture);
    -> whether qgemm can use them. A failure is reported once and remembered."""
    global _API, _FAILED
    if not ENABLED or device.type != "cuda" or _FAILED is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _API is not None and index in _API.funcs:
        return True
    major, minor = torch.cuda.get_device_capability(index)
    try:
        if major < 8:
            raise RuntimeError(f"sm_{major}{minor} has no bf16 conversions (sm_80 or later)")
        with torch.cuda.device(index):
            _API = _API or _Api()
            _API.funcs[index] = _API.load(index, _API.cubin(f"sm_{major}{minor}"))
        return True
    except (OSError, RuntimeError, AttributeError) as e:
        _FAILED = str(e)
        log.warning("q4_0 one-row GEMV in CUDA C++ unavailable (%s); the Triton GEMV is used", e)
        return False


def rows_per_warp(n: int, device: torch.device) -> int:
    """4: the tensor-core kernel (2 row pairs a warp) takes an n-row weight, from 40 x the SMs
    rows (>= 2.5 CTAs of 4 warps an SM; on an H200 q|k|v 6.8, gate|up 23.6, the LM head 93.3 us a
    call against 7.9, 26.8 and 108.3 for the FMA kernel at its best); 2: the FMA kernel, at
    fma_rows() rows a warp."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 4 if n >= 40 * sms else 2


def fma_rows(n: int, device: torch.device) -> int:
    """The FMA kernel's rows a warp: 4 where that still gives every SM a CTA (of 4 warps), else 2,
    else 1. On an H200 4 rows beat 2 at Llama-3-8B's o (4096 rows, 256 CTAs: 4.9 against 5.9 us
    a call) and tied at down (13.5); 1 row was slowest (o 7.8, down 21.9: x's four loads a
    block serve one row). Fewer rows only so that a small weight's warps reach every SM
    (not measured)."""
    if FMA_ROWS is not None:
        return FMA_ROWS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return next(r for r in (4, 2, 1) if n >= 4 * r * sms or r == 1)


def choose(n: int, nblk: int, device: torch.device) -> tuple[tuple[int | str, int], int, int]:
    """The kernel for an n x (32 nblk) weight on `device` (prepared): its key in _Api.funcs, the
    grid (CTAs of 4 warps) and the dynamic shared bytes. q4_ks (KS_ROWS rows a CTA) where the
    tensor-core kernel's rows meet K <= 4,096: on an H200 q|k|v 6.5 against 6.8, gate|up 21.6 /
    23.7, the LM head 85.5 / 94.0 us a call (fp32 products). Fewer rows, K <= 32,768, sm_90:
    q4_ksx (K split over a cluster; o and down of Llama-3-8B: the b1 forward 1.77 against 1.84 ms
    with the FMA kernel, which takes the rest; docs/performance-gpu.md)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if KS and nblk <= 128 and (KS_ALL or rows_per_warp(n, device) == 4):
        return ("ks", KS_ROWS), -(-n // KS_ROWS), 0
    if ksx(nblk, device) and rows_per_warp(n, device) != 4:  # the mma kernel's keep it (not measured)
        return ("ksx", KS_ROWS), -(-n // KS_ROWS) * ksx_cluster(nblk), 0
    smem = 68 * (-(-nblk // 8) * 8)  # q4_mma_rp2's x table
    if not (rows_per_warp(n, device) == 4 and MMA and smem <= _MMA_SMEM_MAX):
        r = fma_rows(n, device)
        return (r, 2), -(-n // (4 * r)), 0
    grid = -(-n // 16)  # 4 warps a CTA, 2 row pairs a warp
    # 4 steps a load group where the grid still fits one wave at that kernel's occupancy, else 2
    # (one H200, device us a call, the two against each other: q|k|v 6.8 / 8.2, gate|up 25.5 /
    # 23.8)
    if STEPS is not None:
        return ("mma", STEPS), grid, smem
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    fits = grid <= _API.ctas_per_sm(index, ("mma", 4), smem) * sms
    return ("mma", 4 if fits else 2), grid, smem


def fused(n: int, nblk: int) -> bool:
    """Whether an n x (32 nblk) weight can take the RMSNorm (and the gated activation) inside its
    GEMV (gemv's `norm`, `act`): q4_ks's CTA covers all of K for K <= 4,096."""
    return _API is not None and nblk <= 128


def fp16_products(key: tuple[int | str, int | str]) -> bool:
    """Whether kernel `key` (choose's, or gemv's fused forms') runs its products in packed fp16 as
    set now: q4_ks's with H2, the FMA kernel's with H2 and H2_ROWS; never the tensor-core one."""
    return bool(H2) and (str(key[0]).startswith("ks") or (H2_ROWS and key[0] != "mma"))


def ksx(nblk: int, device: torch.device) -> bool:
    """Whether q4_ksx takes a weight of nblk blocks a row on `device`: KSX, sm_90 or later (thread
    block clusters), K <= 32,768 (a cluster of at most 8 CTAs)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return KSX and nblk <= _KSX_MAX_NBLK and _major(index) >= 9


def ksx_cluster(nblk: int) -> int:
    """q4_ksx's CTAs a cluster for nblk blocks a row: 128 blocks a CTA."""
    return -(-nblk // 128)


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def handoff_parts(n: int, device: torch.device, nblk: int, *nblks: int) -> int:
    """The partial sums a `norm_out` GEMV of n rows and each of (nblk, *nblks) blocks a row
    writes (one a CTA group of q4_ksx, KS_ROWS rows, where it takes them all; else one a CTA of
    the FMA kernel), or 0 where n does not split evenly into those or the GEMVs would take
    different kernels (then cuda_stack keeps the norm forms)."""
    takes = {ksx(b, device) for b in (nblk, *nblks)}
    if len(takes) > 1:
        return 0
    rows = KS_ROWS if takes.pop() else 4 * fma_rows(n, device)
    return n // rows if n % rows == 0 else 0


def gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, n: int,
         nblk: int, res: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
         act: str | None = None, norm_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
         prenormed: tuple[torch.Tensor, float] | None = None) -> bool:
    """out [1, n] = x [1, K] @ W^T for planar q4_0 `codes` / `scales` (quant_planar._views);
    -> False (nothing launched) where the kernel does not apply: not prepared for this device,
    x or out not bf16, x not 16-byte aligned. The fused forms (model/cuda_stack.py): `res` [1, n]
    bf16 is added to the output (rounded as the linear then the add); `norm` (weight [K] bf16,
    eps): x is the residual stream and the output is W @ rmsnorm(x) (q4_ks only: `fused`);
    `act` with `norm` or `prenormed` ("silu", "gelu_pytorch_tanh"): the weight is gate | up and
    out [1, n / 2] = act(gate) * up. The hand-off between two GEMVs: `norm_out` (nw [n] bf16, hw
    [1, n] bf16, part [handoff_parts(n)] fp32; the FMA kernel) also stores hw = bf16(out * nw)
    and the CTAs' sums of out^2; `prenormed` (that part, eps) on the next GEMV (q4_ks: `fused`),
    given x = hw, is then W @ rmsnorm(out) with norm weight nw, as `norm` on out would be."""
    if _API is None or x.device.type != "cuda":
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    funcs = _API.funcs.get(index)
    if funcs is None or x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 \
            or x.data_ptr() % 16 or codes.data_ptr() % 16:
        return False
    nparts = 0
    if norm is not None or prenormed is not None:
        assert fused(n, nblk) and res is None and not (act and n % 2) and (norm is None or prenormed is None)
        assert norm is None or norm[0].dtype == torch.bfloat16
        key = ("ks_" + ("norm" if norm else "scaled") + (f"_{act}" if act else ""), KS_ROWS)
        grid = -(-(n // 2 if act else n) // (KS_ROWS // 2 if act else KS_ROWS))
        smem = 0
        if prenormed is not None:
            nparts = prenormed[0].numel()
            norm = (None, prenormed[1])
    elif norm_out is not None:
        assert act is None and norm_out[2].dtype == torch.float32
        kx = ksx(nblk, x.device)
        r = KS_ROWS if kx else 4 * fma_rows(n, x.device)  # rows a partial sum (CTA group)
        assert n % r == 0 and norm_out[2].numel() == n // r, (n, r, norm_out[2].shape)
        key, grid = (("ksx_nout", r), n // r * ksx_cluster(nblk)) if kx else ((r // 4, "nout"), n // r)
        smem = 0
    else:
        assert act is None
        key, grid, smem = choose(n, nblk, x.device)
    kernel = funcs[(*key, "h2") if fp16_products(key) else key]
    pdl = programmatic_launch(x.device)
    ptr = (lambda t: ctypes.c_void_p(0 if t is None else t.data_ptr()))
    args = [ptr(x), ptr(codes), ptr(scales), ptr(out), ctypes.c_int(n), ctypes.c_int(nblk),
            ctypes.c_int(_MAGIC), ctypes.c_int(int(pdl)), ptr(res),
            ptr(norm_out[0] if norm_out else None if norm is None else norm[0]),
            ctypes.c_float(0.0 if norm is None else norm[1]), ptr(norm_out[1] if norm_out else None),
            ptr(norm_out[2] if norm_out else prenormed[0] if prenormed else None), ctypes.c_int(nparts)]
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = torch.cuda.current_stream(x.device).cuda_stream
    attrs = (_LaunchAttr * 2)()
    nattr = 0
    if pdl:
        attrs[0].id, attrs[0].value[0], nattr = _PDL_ATTR, 1, 1
    if str(key[0]).startswith("ksx"):  # a cluster of the CTAs that split a row group's K
        attrs[nattr].id, attrs[nattr].value[0], attrs[nattr].value[1], attrs[nattr].value[2] = \
            _CLUSTER_ATTR, ksx_cluster(nblk), 1, 1
        nattr += 1
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(grid, 1, 1), block=(ctypes.c_uint * 3)(128, 1, 1),
                        smem=smem, stream=stream, attrs=ctypes.cast(attrs, ctypes.POINTER(_LaunchAttr)),
                        num_attrs=nattr)
    _API.check(_API.cuda.cuLaunchKernelEx(ctypes.byref(cfg), kernel, params, None),
               "cuLaunchKernelEx q4_gemv")
    return True
