"""The Triton fused MoE (flatserve/ops/fused_moe.py) against the torch reference (model/moe.py)
on random routings, including experts that get no token and one expert that gets every token.

On CUDA the checks run directly (fp32 and bf16); everywhere they also run on the CPU under the
Triton interpreter (TRITON_INTERPRET=1, in a subprocess: the variable must be set before
Triton is imported), which runs the same kernels' code in numpy."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flatserve.model.config import MoeConfig

ROOT = Path(__file__).resolve().parents[2]
QWEN = MoeConfig(num_experts=16, top_k=4, intermediate_size=48, sparse_layers=(True,),
                 norm_topk_prob=True)
OSS = MoeConfig(num_experts=16, top_k=4, intermediate_size=48, sparse_layers=(True,),
                router="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=1.0)


def _weights(moe: MoeConfig, H: int, device: str, dtype: torch.dtype, g: torch.Generator):
    E, I = moe.num_experts, moe.intermediate_size

    def r(*s: int, std: float = 0.2) -> torch.Tensor:
        return (torch.randn(*s, generator=g, device=device) * std).to(dtype)
    return (r(E, H, std=1.0), r(E) if moe.router_bias else None, r(E, 2 * I, H),
            r(E, 2 * I) if moe.expert_bias else None, r(E, H, I), r(E, H) if moe.expert_bias else None)


def _experts_loop(x, ids, w, wgu, bgu, wd, bd, moe):
    """Per-expert loop over given routing: the reference for the two grouped GEMMs."""
    from flatserve.model.layers import ACTIVATIONS
    from flatserve.model.moe import expert_act

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(moe.num_experts):
        tok, slot = torch.where(ids == e)
        if tok.numel():
            h = expert_act(F.linear(x[tok].float(), wgu[e].float(),
                                    None if bgu is None else bgu[e].float()), moe, ACTIVATIONS["silu"])
            y = F.linear(h, wd[e].float(), None if bd is None else bd[e].float())
            out.index_add_(0, tok, y * w[tok, slot, None].float())
    return out


def check_grouped(device: str, dtype: torch.dtype, T: int, moe: MoeConfig, routing: str,
                  H: int = 64, seed: int = 0) -> float:
    """align_by_expert + both grouped GEMMs over a given routing, against the loop."""
    from flatserve.ops.fused_moe import align_by_expert, block_m_for, grouped_gemm

    g = torch.Generator(device=device).manual_seed(seed)
    E, k, I = moe.num_experts, moe.top_k, moe.intermediate_size
    _, _, wgu, bgu, wd, bd = _weights(moe, H, device, dtype, g)
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    used = {"random": E, "few": 5, "one": E}[routing]  # "few": experts 5.. get no token
    ids = torch.stack([torch.randperm(used, generator=g, device=device)[:k] for _ in range(T)])
    if routing == "one":  # expert 7 gets every token (in varying slots)
        ids = torch.stack([torch.randperm(E - 1, generator=g, device=device)[:k] for _ in range(T)])
        ids[ids == 7] = E - 1
        ids[torch.arange(T, device=device), torch.randint(0, k, (T,), generator=g, device=device)] = 7
    w = torch.rand(T, k, generator=g, device=device)
    tiles = {16, block_m_for(T * k, E, dtype.itemsize)}
    if device == "cuda":  # prompt tiles too (128 rows: 16-bit inputs only, see block_m_for)
        tiles |= {64} | ({128} if dtype.itemsize <= 2 else set())
    for bm in sorted(tiles):
        sorted_ids, block_e = align_by_expert(ids.int(), E, bm)
        h = torch.full((T * k, I), float("nan"), dtype=dtype, device=device)
        grouped_gemm(x, wgu, bgu, h, sorted_ids, block_e, bm, k, I, gated=True, moe=moe)
        y = torch.full((T * k, H), float("nan"), dtype=dtype, device=device)
        grouped_gemm(h, wd, bd, y, sorted_ids, block_e, bm, 1, H, topw=w.view(-1))
        out = y.view(T, k, H).float().sum(1)
        ref = _experts_loop(x, ids, w, wgu, bgu, wd, bd, moe)
        err = ((out - ref).norm() / ref.norm()).item()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert err < tol, f"{routing} T={T} BLOCK_M={bm}: rel err {err:.2e}"
    return err


def check_route_and_full(device: str, dtype: torch.dtype, T: int, moe: MoeConfig, H: int = 64,
                         seed: int = 0) -> None:
    """The routing kernel against route() (same experts, weights to 1e-6), and fused_moe
    end to end against moe_ref."""
    from flatserve.model.layers import ACTIVATIONS
    from flatserve.model.moe import moe_ref, route
    from flatserve.ops.fused_moe import fused_moe
    from flatserve.ops.fused_moe import route as route_fused

    g = torch.Generator(device=device).manual_seed(seed)
    weights = _weights(moe, H, device, dtype, g)
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    w_ref, ids_ref = route(x.float(), weights[0].float(),
                           None if weights[1] is None else weights[1].float(), moe)
    w, ids = route_fused(x.float(), weights[0].float(),
                         None if weights[1] is None else weights[1].float(), moe)
    assert torch.equal(ids.long(), ids_ref), "routing kernel chose other experts"
    assert (w - w_ref).abs().max().item() < 1e-6
    out = fused_moe(x, *weights, moe)
    ref = moe_ref(x.float(), *[None if t is None else t.float() for t in weights], moe,
                  ACTIVATIONS["silu"])
    err = ((out.float() - ref).norm() / ref.norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert err < tol, f"fused_moe T={T}: rel err {err:.2e}"


def run_all(device: str, dtype: torch.dtype) -> None:
    for moe in (QWEN, OSS):
        for T in (1, 37):
            for routing in ("random", "few", "one"):
                check_grouped(device, dtype, T, moe, routing, seed=T)
            check_route_and_full(device, dtype, T, moe, seed=T + 1)
    print("OK")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernels "
                    "(test_fused_moe_cuda); the interpreter check is for CPUs")
def test_fused_moe_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "import torch; from tests.ops.test_fused_moe import run_all; run_all('cpu', torch.float32)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused MoE kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_cuda(dtype: torch.dtype) -> None:
    run_all("cuda", dtype)
    for moe in (QWEN, OSS):  # a prefill-sized batch (64/128-row tiles) and real widths
        check_grouped("cuda", dtype, 2048, moe, "random", H=256)
        check_route_and_full("cuda", dtype, 2048, moe, H=256)
