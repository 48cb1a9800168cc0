"""The C++ fused ops (flatserve/ops/cpu_ops.py) against the torch layers they replace, on the CPU:
Gemma 3 270M shapes (hidden 640, MLP 2048, 4 q heads / 1 KV head of 256), bf16, at 16 rows (a
decode step) and 2,048 rows (a prefill chunk); SiLU at the same shapes for Qwen3/Llama. ms per call, same inputs, same run.
Where AMX runs, also the gate_up projection (4,096 x 640) with GELU-tanh: the AMX linear then
act_and_mul, against the gated GEMM that applies the activation in its epilogue (min of 5 x 10
calls each, alternated; outputs asserted equal).

    .venv/bin/python benchmarks/dev/cpu_fused_ops.py [--rev REV]

--rev REV: instead, RMSNorm + residual and q/k norm + rotary of the C++ module as it is at git
revision REV against the working tree's, built side by side, same inputs, alternated (min of 5 x
10 calls each).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.common import ms_per_call  # noqa: E402
from flatserve.model.config import RopeConfig  # noqa: E402
from flatserve.model.layers import RMSNorm, Rotary  # noqa: E402
from flatserve.ops import cpu_ops  # noqa: E402


def main() -> None:
    dt = torch.bfloat16
    torch.manual_seed(0)
    for T in (16, 2048):
        x, r = torch.randn(T, 640, dtype=dt), torch.randn(T, 640, dtype=dt)
        norm = RMSNorm(640, 1e-6, 1.0).to(dt)
        a = ms_per_call(lambda: norm(x, r.clone()))
        b = ms_per_call(lambda: cpu_ops.rms_norm(x, norm.weight, 1e-6, True, r.clone()))
        print(f"{T} rows: RMSNorm + residual  torch {a:.3f} ms, fused {b:.3f} ms ({a / b:.1f}x)")
        g = torch.randn(T, 4096, dtype=dt)
        a = ms_per_call(lambda: F.gelu(g[:, :2048], approximate="tanh") * g[:, 2048:])
        b = ms_per_call(lambda: cpu_ops.act_and_mul(g, "gelu_pytorch_tanh"))
        print(f"{T} rows: GELU-tanh(gate) * up torch {a:.3f} ms, fused {b:.3f} ms ({a / b:.1f}x)")
        a = ms_per_call(lambda: F.silu(g[:, :2048]) * g[:, 2048:])  # Qwen3 / Llama MLPs
        b = ms_per_call(lambda: cpu_ops.act_and_mul(g, "silu"))
        print(f"{T} rows: SiLU(gate) * up      torch {a:.3f} ms, fused {b:.3f} ms ({a / b:.1f}x)")
        rot = Rotary(RopeConfig(theta=1e4), 256)
        qkv = torch.randn(T, 6 * 256, dtype=dt)
        q, k, _ = qkv.split([1024, 256, 256], -1)
        q, k = q.view(T, 4, 256), k.view(T, 1, 256)
        pos = torch.arange(T)
        qn, kn = RMSNorm(256, 1e-6, 1.0).to(dt), RMSNorm(256, 1e-6, 1.0).to(dt)
        table = rot.table(T + 1)
        a = ms_per_call(lambda: rot(pos, qn(q), kn(k), T))
        b = ms_per_call(lambda: cpu_ops.qk_norm_rope(q, k, pos, table, qn.weight, kn.weight, 1e-6, True))
        print(f"{T} rows: q/k norm + rotary    torch {a:.3f} ms, fused {b:.3f} ms ({a / b:.1f}x)")
        gated_gemm(T)


def ab(rev: str) -> None:
    from benchmarks.common import build_at_rev

    mods = {rev: build_at_rev("flatserve/ops/csrc/fused_cpu.cpp", rev, "fused_ab"),
            "working tree": cpu_ops.module()}
    dt = torch.bfloat16
    torch.manual_seed(0)
    for T in (16, 2048):
        x, r, w = torch.randn(T, 640, dtype=dt), torch.randn(T, 640, dtype=dt), torch.randn(640, dtype=dt)
        qkv = torch.randn(T, 6 * 256, dtype=dt)
        table, wq, pos = Rotary(RopeConfig(theta=1e4), 256).table(T + 1), torch.randn(256, dtype=dt), torch.arange(T)

        def rope(m):  # on a fresh copy: in place, repeated calls would compound
            qk = qkv.clone()
            m.qk_norm_rope(qk[:, :1024].view(T, 4, 256), qk[:, 1024:1280].view(T, 1, 256), pos,
                           table, wq, wq, 1e-6, True, True)

        for name, fn in (("RMSNorm + residual", lambda m: m.rms_norm(x, w, 1e-6, True, r.clone())),
                         ("q/k norm + rotary", rope)):
            best = {k: float("inf") for k in mods}
            for _ in range(5):
                for k, m in mods.items():
                    best[k] = min(best[k], ms_per_call(lambda: fn(m)))
            print(f"{T} rows: {name:20s} " + ", ".join(f"{k} {v:.3f} ms" for k, v in best.items()))


def gated_gemm(T: int) -> None:
    from flatserve.model import amx

    if not amx.available(torch.bfloat16):
        return
    w = torch.randn(4096, 640, dtype=torch.bfloat16) * 0.05
    x = torch.randn(T, 640, dtype=torch.bfloat16)
    two, gated = amx.AMXLinear(w, None), amx.AMXLinear(w, None)
    assert gated.make_gated("gelu_pytorch_tanh")
    assert torch.equal(gated(x), cpu_ops.act_and_mul(two(x), "gelu_pytorch_tanh"))
    a = b = float("inf")
    for _ in range(5):
        a = min(a, ms_per_call(lambda: cpu_ops.act_and_mul(two(x), "gelu_pytorch_tanh")))
        b = min(b, ms_per_call(lambda: gated(x)))
    print(f"{T} rows: gate_up + GELU-tanh   linear + act_and_mul {a:.3f} ms, gated GEMM {b:.3f} ms "
          f"({a / b:.2f}x)")


if __name__ == "__main__":
    if "--rev" in sys.argv:
        ab(sys.argv[sys.argv.index("--rev") + 1])
    else:
        main()
