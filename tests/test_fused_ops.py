"""Fused ops (flatserve/ops) against the torch layers they replace: the Triton kernels on CUDA,
the C++ ones on the CPU at every ISA level this CPU runs (each implementation skipped where it
cannot run, saying why). Inputs are seeded per test (the test's id), so a run is reproducible."""
from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

from flatserve.model.config import RopeConfig
from flatserve.model.layers import RMSNorm, Rotary

DTYPES = [torch.float32, torch.bfloat16]


CPU_LEVELS = ["amx", "avx512", "avx2", "portable"]


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)


def _cpu_ops_at(level: str, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202 - the ops module
    from flatserve.ops import cpu_ops
    from tests.conftest import _at_level, require_kernel

    _at_level(level, monkeypatch)
    require_kernel(cpu_ops.module)
    return cpu_ops


@pytest.fixture(params=["triton", *(f"cpu-{lv}" for lv in CPU_LEVELS)])
def impl(request, monkeypatch):
    """-> (the ops module, its device): Triton on CUDA, the C++ ops at each ISA level."""
    if request.param == "triton":
        # TRITON_INTERPRET=1 runs the kernels on CPU tensors (numpy), for checks without a GPU.
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if not torch.cuda.is_available() and not interp:
            pytest.skip("needs CUDA (or TRITON_INTERPRET=1)")
        from flatserve.ops import triton_ops

        return triton_ops, "cpu" if interp else "cuda"
    return _cpu_ops_at(request.param.removeprefix("cpu-"), monkeypatch), "cpu"


@pytest.fixture
def triton_ops_dev():
    """-> (triton_ops, its device), for what only the Triton ops do."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not (torch.cuda.is_available() or interpret):
        pytest.skip("needs CUDA (or TRITON_INTERPRET=1)")
    from flatserve.ops import triton_ops

    return triton_ops, "cpu" if interpret else "cuda"


@pytest.fixture(params=CPU_LEVELS)
def cpu_ops(request, monkeypatch):  # noqa: ANN201 - the C++ ops module at one ISA level
    return _cpu_ops_at(request.param, monkeypatch)


# The bit-identical share is measured on at least this many elements (see _close).
MIN_ELEMENTS = 20_000


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: reduction order only. bf16: the same roundings as torch, so each element is torch's
    # or a neighbour: the fp32 values before the rounding differ by ~1e-7 relative (exp/tanh
    # polynomials, sum order), far below a bf16 ulp (2^-8 relative), so only values that land
    # on a rounding boundary's other side differ; a wrong rounding or formula breaks the
    # tolerance. The bit-identical share is a statistic: ~0.95 for the tanh-GELU, lower for
    # nothing else. Its bar (0.9) holds on samples of MIN_ELEMENTS or more, where the share's
    # standard deviation is sqrt(0.05 * 0.95 / 20,000) = 0.0015, i.e. 30 of them from the bar;
    # a 100-element draw (sd 0.022) once drew 0.893, which is why smaller outputs skip it.
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=1e-2)
        if out.numel() >= MIN_ELEMENTS:
            assert (out == ref).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [640, 1024, 4096, 200])  # 200: the CPU ops' scalar path
def test_rms_norm(impl, dtype, offset, hidden) -> None:
    ops, dev = impl
    rms_norm = ops.rms_norm
    n = random.randint(-(-MIN_ELEMENTS // hidden), 300)
    norm = RMSNorm(hidden, 1e-6, offset).to(dev, dtype)
    norm.weight.data.normal_(0.0, 0.5)
    base = torch.randn(n, hidden + 64, device=dev, dtype=dtype) * 3
    x = base[:, :hidden]  # rows with a stride wider than the row (a view)
    res = torch.randn(n, hidden, device=dev, dtype=dtype)
    _close(rms_norm(x, norm.weight, norm.eps, bool(offset)), norm(x), dtype)
    ref_y, ref_r = norm(x, res)
    res_fused = res.clone()
    y = rms_norm(x, norm.weight, norm.eps, bool(offset), res_fused)
    assert torch.equal(res_fused, ref_r), "residual += x must round like torch's add"
    _close(y, ref_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hkv,norm,offset,rot_dim", [
    (128, 16, 8, True, 0.0, 128), (64, 8, 1, False, 0.0, 64), (256, 4, 1, True, 1.0, 256),
    (128, 32, 8, False, 0.0, 128),
    (40, 4, 2, True, 1.0, 40),  # 40: the CPU ops' scalar path (half a head not 16 lanes)
    (80, 4, 2, True, 0.0, 80), (96, 4, 4, False, 0.0, 96),  # halves 40, 48: padded in Triton
    (128, 4, 2, True, 0.0, 96), (96, 4, 2, False, 0.0, 72),  # partial rotary (Phi-4-mini: 0.75)
    (80, 2, 1, True, 1.0, 40)])
def test_qk_norm_rope(impl, dtype, head_dim, hq, hkv, norm, offset, rot_dim) -> None:
    ops, dev = impl
    qk_norm_rope = ops.qk_norm_rope
    ok, why = ops.rope_fits(head_dim, rot_dim)
    if not ok:  # the layer then keeps the torch path (ops.enable); the op itself refuses
        assert dev == "cpu" and rot_dim != head_dim, why
        pytest.skip(f"{ops.__name__} does not take it: {why}")
    T = random.randint(-(-MIN_ELEMENTS // (hkv * head_dim)), 400)
    rot = Rotary(RopeConfig(theta=random.choice([1e4, 1e6])), rot_dim).to(dev)
    qkv = torch.randn(T, (hq + 2 * hkv) * head_dim, device=dev, dtype=dtype) * 2
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1)
    q, k = q.view(T, hq, head_dim), k.view(T, hkv, head_dim)  # views, as in Attention.forward
    pos = torch.randint(0, 5000, (T,), device=dev)
    qn, kn = RMSNorm(head_dim, 1e-6, offset), RMSNorm(head_dim, 1e-6, offset)
    for m in (qn, kn):
        m.to(dev, dtype).weight.data.normal_(0.0, 0.5)
    rq, rk = (qn(q), kn(k)) if norm else (q, k)
    rq, rk = rot(pos, rq, rk, 4999)
    table = rot.table(5000)
    qk_norm_rope(q, k, pos, table, qn.weight if norm else None, kn.weight if norm else None,
                 1e-6, bool(offset))
    _close(q, rq, dtype)
    _close(k, rk, dtype)
    if not norm and ops.__name__.endswith("triton_ops"):  # torch's three roundings, bit for bit:
        # FP fusion on, the fp16 products and sum contracted into fma.rn.f16 and this failed
        assert torch.equal(q, rq) and torch.equal(k, rk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,offset", [(640, True), (1024, False), (200, True)])
def test_cpu_norm_pair_equals_two_norms(cpu_ops, dtype, hidden: int, offset: bool) -> None:
    """rms_norm_pair(x, w1, w2, residual) is rms_norm(rms_norm(x, w1), w2, residual), bits and
    the residual's update included (200: the scalar rows)."""
    n = random.randint(1, 300)
    x = (torch.randn(n, hidden + 32) * 3).to(dtype)[:, :hidden]  # strided rows, as views are
    w1, w2 = (torch.randn(hidden) * 0.5).to(dtype), (torch.randn(hidden) * 0.5).to(dtype)
    res = (torch.randn(n, hidden) * 10).to(dtype)
    r_ref, r_got = res.clone(), res.clone()
    ref = cpu_ops.rms_norm(cpu_ops.rms_norm(x, w1, 1e-6, offset), w2, 1e-6, offset, r_ref)
    got = cpu_ops.rms_norm_pair(x, w1, w2, 1e-6, offset, r_got)
    assert torch.equal(got, ref) and torch.equal(r_got, r_ref)
    assert not torch.equal(r_got, res)  # the residual did take the first norm's output


def test_cpu_ops_reject_mismatched_shapes(cpu_ops) -> None:
    """A weight or table of the wrong size, or a position past the table, raises instead of
    reading past the end."""
    x = torch.randn(4, 640).bfloat16()
    with pytest.raises(RuntimeError, match="w \\[H\\]"):
        cpu_ops.rms_norm(x, torch.ones(320).bfloat16(), 1e-6, False)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_ops.rms_norm(x, torch.ones(640).bfloat16(), 1e-6, False, torch.randn(2, 640).bfloat16())
    with pytest.raises(RuntimeError, match="weights"):
        cpu_ops.rms_norm_pair(x, torch.ones(640).bfloat16(), torch.ones(64).bfloat16(), 1e-6, False,
                              torch.randn(4, 640).bfloat16())
    q, k = torch.randn(3, 4, 64).bfloat16(), torch.randn(3, 1, 64).bfloat16()
    table, w = torch.randn(2, 16, 64), torch.ones(64).bfloat16()
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_ops.qk_norm_rope(q, k, torch.tensor([0, 5, 16]), table, w, w, 1e-6, False)
    with pytest.raises(RuntimeError, match="table"):
        cpu_ops.qk_norm_rope(q, k, torch.tensor([0, 1, 2]), table[:, :, :32].contiguous(), w, w,
                             1e-6, False)
    with pytest.raises(RuntimeError, match="norm weights"):
        cpu_ops.qk_norm_rope(q, k, torch.tensor([0, 1, 2]), table, w[:32], w, 1e-6, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hkv,norm,rot_dim", [
    (128, 8, 2, True, 128), (64, 4, 4, False, 64), (96, 4, 2, False, 72), (128, 4, 2, True, 96)])
def test_rope_with_the_kv_write_equals_rope_then_store_kv(triton_ops_dev, dtype, head_dim, hq, hkv,
                                                          norm, rot_dim) -> None:
    """The Triton rope op taking store_kv's write (Attention then only attends): the same q and k,
    and the same cache contents as the rope op followed by store_kv, padded rows (slot -1)
    storing nothing; partial rotary's pass-through dims stored too."""
    ops, dev = triton_ops_dev
    assert ops.ROPE_STORES_KV  # Attention relies on it (flatserve.ops.enable)
    from flatserve.attention.kernels.store_kv import store_kv

    T, bs, blocks = random.randint(1, 40), 16, 8
    rot = Rotary(RopeConfig(theta=1e4), rot_dim).to(dev)
    qkv = torch.randn(T, (hq + 2 * hkv) * head_dim, device=dev, dtype=dtype) * 2
    sizes = [hq * head_dim, hkv * head_dim, hkv * head_dim]
    q, k, v = (t.view(T, -1, head_dim) for t in qkv.split(sizes, -1))
    pos = torch.randint(0, 500, (T,), device=dev)
    slots = torch.randperm(blocks * bs, device=dev)[:T]
    slots[torch.rand(T, device=dev) < 0.2] = -1  # padded graph rows
    kc = torch.randn(blocks, bs, hkv, head_dim, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    w = [torch.randn(head_dim, device=dev, dtype=dtype) * 0.5 + 1 if norm else None for _ in range(2)]
    table = rot.table(500)
    q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
    ops.qk_norm_rope(q2, k2, pos, table, *w, 1e-6, False)
    store_kv(k2, v, kc2, vc2, slots)
    ops.qk_norm_rope(q, k, pos, table, *w, 1e-6, False, store=(v, kc, vc, slots))
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("inter", [2048, 3072, 14336, 100])
def test_act_and_mul(impl, dtype, act, inter) -> None:
    ops, dev = impl
    act_and_mul = ops.act_and_mul
    T = random.randint(-(-MIN_ELEMENTS // inter), 250)
    x = torch.randn(T, 2 * inter, device=dev, dtype=dtype) * 3
    g, u = x.chunk(2, -1)
    ref = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
    _close(act_and_mul(x, act), ref, dtype)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "phi3", "smollm3", "granite", "gemma2"])
@pytest.mark.parametrize("backend", ["triton", *(f"cpu-{lv}" for lv in CPU_LEVELS)])
def test_fused_model_matches_unfused(backend, family, tmp_path, monkeypatch) -> None:
    """The residual wiring and every op in a whole model: fp32 first-token logprobs of ragged
    prompts agree to 1e-4 with fused ops on and off (same attention backend: Triton on CUDA,
    the C++ decode kernel at each ISA level on the CPU)."""
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if backend.startswith("cpu-"):
        from flatserve.attention import cpu_backend
        from tests.conftest import require_kernel

        _cpu_ops_at(backend.removeprefix("cpu-"), monkeypatch)
        require_kernel(cpu_backend.kernel)
        backend = "cpu"
    from flatserve import LLM, SamplingParams
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint(family, tmp_path)
    rng = random.Random(random.random())  # seeded by _seeded
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(1, 300))] for _ in range(8)]
    sp = SamplingParams(max_tokens=4, temperature=0, logprobs=5, ignore_eos=True)
    outs = []
    for fused in ("auto", "none"):
        llm = LLM(model=str(path), dtype="float32", attention_backend=backend, fused_ops=fused,
                  device="cuda" if backend == "triton" else "cpu",
                  kv_cache_memory=2**28, max_model_len=512)  # 256 MiB: a small share on a GPU
        assert llm.engine.state.fused_ops == (frozenset({"rmsnorm", "rope", "act"}) if fused == "auto"
                                              else frozenset())
        outs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
        del llm
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        da, db = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for t in set(da) & set(db):
            assert abs(da[t].logprob - db[t].logprob) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_row_argmax_equals_torch_max_indices(cpu_ops, dtype: torch.dtype) -> None:
    """The greedy sampler's CPU argmax: torch's rule exactly, on fresh random rows of several
    widths (one row split across threads, tails shorter than 16 lanes), with exact ties,
    NaNs and all -inf rows."""
    from flatserve import kernels

    for R, V in [(16, 40_000), (1, 300_001), (3, 37), (4, 1), (2, 16), (7, 4100)]:
        x = torch.randn(R, V).to(dtype)
        if V > 20:
            for r in range(R):  # an exact tie at two random places above every other value
                i, j = sorted(random.sample(range(V), 2))
                x[r, i] = x[r, j] = x[r].max() + 1
        if R > 2 and V > 20:
            x[1, random.randrange(V // 2, V)] = float("nan")
            x[1, random.randrange(V // 2)] = float("nan")
            x[2] = float("-inf")
        got = kernels.row_argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.max(dim=-1).indices), (R, V)
