"""What one kernel that only reads can reach on this GPU, by size and by bytes in flight: the
practical floor of a one-row GEMV that reads the same bytes. A grid of C CTAs an SM, 128 threads
each, every thread keeping L 16-byte loads in flight (C x 128 x L x 16 bytes an SM), over the
sizes of Llama-3-8B's q4_0 linears; device us a call in a CUDA graph with the buffers rotated
over 2x the L2, as benchmarks/dev/gemv_kernels.py times the GEMVs.

    PYTHONPATH=. python3 benchmarks/dev/read_floor.py
"""
from __future__ import annotations

import ctypes
import sys

sys.path.insert(0, ".")

SRC = rb"""
struct alignas(16) U4 { unsigned x, y, z, w; };
template <int L>
__device__ __forceinline__ void rd(const U4* p, unsigned long long n16, unsigned* out) {
  unsigned acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (L - 1) * stride < n16; i += L * stride) {
    U4 v[L];
#pragma unroll
    for (int j = 0; j < L; ++j)
      asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w) : "l"(p + i + j * stride));
#pragma unroll
    for (int j = 0; j < L; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n16; i += stride) acc ^= p[i].x;
  if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads
}
#define K(L) extern "C" __global__ void __launch_bounds__(128, 1) rd##L(const U4* p, unsigned long long n, \
    unsigned* out) { rd<L>(p, n, out); }
K(1) K(2) K(4) K(8) K(16)
"""
SIZES = {"o 9.4 MB": 9_437_184, "qkv 14.2 MB": 14_155_776, "down 33 MB": 33_030_144,
         "gate_up 66 MB": 66_060_288, "head 295 MB": 295_501_824}


def main() -> None:
    import torch

    from benchmarks.dev.quant_gemm_gpu import graph_us
    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import cuda_gemv

    dev = torch.device("cuda")
    assert cuda_gemv.prepare(dev)
    api = cuda_gemv._API
    major, minor = torch.cuda.get_device_capability()
    mod = ctypes.c_void_p()
    api.check(api.cuda.cuModuleLoadData(ctypes.byref(mod), api.compile(f"sm_{major}{minor}", SRC)), "load")
    funcs = {}
    for L in (1, 2, 4, 8, 16):
        f = ctypes.c_void_p()
        api.check(api.cuda.cuModuleGetFunction(ctypes.byref(f), mod, f"rd{L}".encode()), "rd")
        funcs[L] = f
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bw = copy_bandwidth()
    print(torch.cuda.get_device_name(), f"copy {bw / 1e9:.0f} GB/s, {sms} SMs", flush=True)
    out = torch.zeros(1, dtype=torch.int32, device=dev)

    def launch(f, buf: torch.Tensor, grid: int) -> None:
        a = [ctypes.c_void_p(buf.data_ptr()), ctypes.c_ulonglong(buf.numel() // 16),
             ctypes.c_void_p(out.data_ptr())]
        params = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in a])
        stream = torch.cuda.current_stream().cuda_stream  # the capture's stream inside a graph
        api.check(api.cuda.cuLaunchKernel(f, grid, 1, 1, 128, 1, 1, 0, ctypes.c_void_p(stream), params, None),
                  "launch")

    for name, size in SIZES.items():
        bufs = [torch.empty(size, dtype=torch.uint8, device=dev).random_(0, 255)
                for _ in range(max(1, -(-2 * l2 // size)))]
        best, rows = None, []
        for ctas in (2, 4, 8, 16):
            cells = []
            for L in (1, 2, 4, 8, 16):
                us = graph_us([lambda b=b: launch(funcs[L], b, ctas * sms) for b in bufs])
                cells.append(f"{us:5.1f}")
                if best is None or us < best[0]:
                    best = (us, ctas, L)
            rows.append(f"  {ctas:2d} CTAs/SM, L = 1/2/4/8/16: " + " ".join(cells))
        print(f"{name}: floor {size / bw * 1e6:.1f} us; best {best[0]:.1f} us ({size / best[0] / 1e3:.0f} GB/s, "
              f"{best[1]} CTAs/SM, {best[2]} loads a thread)", flush=True)
        print("\n".join(rows), flush=True)
        del bufs


if __name__ == "__main__":
    main()
