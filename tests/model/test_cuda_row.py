"""The RMSNorm folded into the one-row q4_0 GEMV (ops/csrc/q4_gemv_cuda.cu q4_gemv_norm_*,
flatserve/model/cuda_row.py): the normalized row the kernel multiplies, read back through
identity weights, has the Triton norm's bits (its sum of squares in another order may move an
element by one ulp); the running residual it stores is bf16(delta + residual) exactly; its output
is within the roundings' bound of a float64 reference; and in the engine, one-row steps with the
fold give the logprobs of the same steps without it. Needs CUDA (the kernel is CUDA C++)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the kernel is CUDA C++)", allow_module_level=True)

from flatserve.model import cuda_gemv, cuda_row, quant_planar  # noqa: E402
from flatserve.ops import triton_ops  # noqa: E402
from tests.model.test_cuda_gemv import FMT, _weights  # noqa: E402

DEV = torch.device("cuda")
EPS = 1e-5


@pytest.fixture(scope="module")
def ready() -> None:
    if not cuda_gemv.prepare(DEV):
        pytest.skip(f"the CUDA C++ GEMV did not build here: {cuda_gemv._FAILED}")


def _identity(k: int) -> torch.Tensor:
    """Planar q4_0 weights with W = I (k x k): row n's block n // 32 holds value n % 32 = 1
    (code 9, scale 1), every other value 0 (code 8), so out[n] = x[n] exactly."""
    raw = torch.zeros(k, k // 32, 18, dtype=torch.uint8)
    raw[:, :, :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    raw[:, :, 2:] = 0x88
    n = torch.arange(k)
    v = n % 32  # byte v % 16: low nibble value v, high nibble value v + 16
    raw[n, n // 32, 2 + v % 16] = torch.where(v < 16, 0x89, 0x98).to(torch.uint8)
    return quant_planar.repack(raw.reshape(k, -1).to(DEV), FMT)


def _fold(p: torch.Tensor, d: torch.Tensor, res: torch.Tensor | None, w: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales, nblk = quant_planar._views(p, FMT)
    n = p.shape[0]
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    res_out = torch.full_like(d, float("nan"))
    assert cuda_gemv.gemv_norm(d, res, w, EPS, None if res is None else res_out, codes, scales, out, n,
                               nblk)
    return out, res_out


@pytest.mark.parametrize("k,with_res", [(4096, True), (640, True), (4096, False)])
def test_folded_norm_row_is_the_triton_norm(ready, k: int, with_res: bool) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    d = (torch.randn(1, k, generator=g) * 3).bfloat16().to(DEV)
    res = torch.randn(1, k, generator=g).bfloat16().to(DEV) if with_res else None
    w = (1 + 0.2 * torch.randn(k, generator=g)).bfloat16().to(DEV)
    x, res_out = _fold(_identity(k), d, res, w)
    r = None if res is None else res.clone()
    ref = triton_ops.rms_norm(d, w, EPS, False, r)  # r += d in place
    if res is not None:
        assert torch.equal(res_out, r)  # bf16(d + res), bit for bit
        assert torch.equal(res_out, (d.float() + res.float()).bfloat16())
    same = (x == ref).float().mean().item()
    ulp = (x.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7
    assert same >= 0.99 and ulp.all(), (same, (~ulp).sum().item())


def test_folded_gemv_matches_float64_reference(ready) -> None:
    """The kernel's row differs from w h / rms(h) by its two bf16 roundings (2^-7 relative in
    all) and its fp32 rms (2^-16 is ample), and the GEMV's sums and output round as in
    test_cuda_gemv._check."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    n, k = 6151, 4096
    p, wd = _weights(n, k, g)
    d = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    res = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    w = (1 + 0.2 * torch.randn(k, generator=g)).bfloat16().to(DEV)
    out, _ = _fold(p, d, res, w)
    h = (d.float() + res.float()).bfloat16().double().cpu().reshape(-1)
    xn = w.double().cpu() * h / torch.sqrt((h * h).mean() + EPS)
    ref = wd @ xn
    mag = wd.abs() @ xn.abs()
    acc = (k / 32 / 8 + 16) * 2.0 ** -24 * mag
    bound = (2.0 ** -7 + 2.0 ** -16) * mag * (1 + 2.0 ** -7) + acc
    bound = (ref.abs() + bound) * 2.0 ** -8 + bound
    err = (out.double().cpu().reshape(-1) - ref).abs()
    assert torch.isfinite(out).all() and (err <= bound).all(), (err - bound).max()


def test_engine_one_row_steps_with_the_fold_match_without(tmp_path, monkeypatch) -> None:
    """A q4_0 Llama served one request at a time (every step one row: the one-token prompt's and
    the decode steps, graphs off and on): each step's top-5 logprobs with the fold agree with the
    unfolded layers' to 0.02 nats while the tokens agree."""
    from flatserve import LLM, SamplingParams
    from flatserve.model.layers import DecoderLayers
    from tests.conftest import build_checkpoint

    monkeypatch.setenv("FLATSERVE_CACHE", str(tmp_path / "cache"))
    path, _ = build_checkpoint("llama", tmp_path)
    rng = random.Random()
    prompts = [[rng.randrange(4, 512)] for _ in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    runs = {}
    for eager in (True, False):
        for fold in (True, False):
            monkeypatch.setattr(cuda_row, "ENABLED", fold)
            llm = LLM(model=str(path), dtype="bfloat16", device="cuda", quantization="q4_0",
                      enforce_eager=eager, kv_cache_memory=2**26, max_model_len=256,
                      enable_prefix_caching=False)
            stacks = [m.fast for m in llm.engine.runner.model.modules() if isinstance(m, DecoderLayers)]
            assert [isinstance(s, cuda_row.FoldedNorms) for s in stacks] == [fold], stacks
            runs[eager, fold] = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
                                 for p in prompts]
            del llm
            torch.cuda.empty_cache()
    for eager in (True, False):
        for a, b in zip(runs[eager, True], runs[eager, False]):
            for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
                da, db = a.logprobs[i], b.logprobs[i]
                shared = [t for t in da if t in db]
                assert len(shared) >= 3, (sorted(da), sorted(db))
                worst = max(abs(da[t].logprob - db[t].logprob) for t in shared)
                assert worst < 0.02, f"step {i}: logprobs differ by {worst:.3f}"
                if ta != tb:
                    break
