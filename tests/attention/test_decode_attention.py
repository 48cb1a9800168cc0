"""The fused decode attention (rope + KV write + attention + split-KV merge in one launch,
attention/kernels/decode_attention.py) against the three kernels it replaces (triton_ops.
qk_norm_rope with the KV write, unified_attention, its merge), on fresh random cases: the output
within the order of fp32 sums, the caches bit for bit without q/k norm (a rounding with it), the
output against the float64 torch reference as tests/attention/test_kernels.py bounds the
unfused kernel; the new token's slot holds NaN before the step, so a tile that read it instead
of the registers' key fails. On the CPU it runs under the Triton interpreter in a
subprocess (TRITON_INTERPRET=1 must be set before Triton is imported); on CUDA compiled."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the attention kernels need triton")
ROOT = Path(__file__).resolve().parents[2]


def _table(P: int, R: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    f = torch.arange(P, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([f, f], -1)
    return torch.stack([emb.cos(), emb.sin()]).float()  # [2, P, R]


def one_case(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, rot: int, bs: int,
             norm: str, window: int | None, softcap: float | None, sinks: bool, segments: int,
             seq_lens: list[int], pad: bool = False) -> None:
    from flatserve.attention.base import LayerAttnParams
    from flatserve.attention.kernels.decode_attention import decode_attention
    from flatserve.attention.kernels.unified_attention import unified_attention
    from flatserve.attention.torch_backend import paged_attention_ref
    from flatserve.ops.triton_ops import qk_norm_rope
    from tests.attention.cases import make_case, rel_err

    S = len(seq_lens)
    q, kc, vc, meta = make_case([1] * S, seq_lens, hq, hkv, d, bs, dtype, device=device)
    if pad:  # the last sequence as a decode graph's padded row: length 1, block 0, no slot
        meta.seq_lens[-1], meta.seq_lens_host[-1] = 1, 1
        meta.block_table[-1] = 0
        meta.slot_mapping[-1] = -1
    live = slice(0, S - 1) if pad else slice(None)  # rows whose output counts
    slots = meta.slot_mapping[live]
    kc.view(-1, hkv, d)[slots] = float("nan")  # the new token's slot is stale before the step
    vc.view(-1, hkv, d)[slots] = float("nan")
    k = torch.randn(S, hkv, d, device=device).to(dtype)
    v = torch.randn(S, hkv, d, device=device).to(dtype)
    idx = meta.seq_lens.long() - 1
    table = _table(max(seq_lens) + 3, rot).to(device)
    qw = kw = None
    if norm:
        qw, kw = (torch.randn(d, device=device) * 0.3 + (0 if norm == "offset" else 1)).to(dtype), \
            (torch.randn(d, device=device) * 0.3 + (0 if norm == "offset" else 1)).to(dtype)
    rope = (idx, table, qw, kw, 1e-6, norm == "offset")
    p = LayerAttnParams(d ** -0.5, window, softcap)
    sk = torch.randn(hq, device=device) if sinks else None

    kc1, vc1, q1, k1 = kc.clone(), vc.clone(), q.clone(), k.clone()
    qk_norm_rope(q1, k1, idx, table, qw, kw, 1e-6, norm == "offset", store=(v, kc1, vc1, meta.slot_mapping))
    want = unified_attention(q1, kc1, vc1, meta, p, sk, segments=segments)
    for rep in range(2):  # twice: the merge counts reset themselves
        kc2, vc2 = kc.clone(), vc.clone()
        got = decode_attention(q, k, v, kc2, vc2, meta, p, rope, sk, segments=segments)
        tag = (dtype, hq, hkv, d, rot, bs, norm, window, softcap, sinks, segments, seq_lens, pad, rep)
        # The same arithmetic in another order of fp32 sums (the merge's; the MMA takes q from
        # registers here, from memory there): a half-precision rounding flips now and then.
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        assert rel_err(got[live], want[live]) < tol, (tag, rel_err(got[live], want[live]))
        if norm:  # the norm's sum of squares in another order: a rounding at most (new rows only)
            new2, new1 = kc2.view(-1, hkv, d)[slots], kc1.view(-1, hkv, d)[slots]
            assert rel_err(new2, new1) < (1e-5 if dtype == torch.float32 else 1e-2), tag
            rest = torch.ones(kc.view(-1, hkv, d).shape[0], dtype=torch.bool, device=device)
            rest[slots] = False  # and no other row written
            assert torch.equal(kc2.view(-1, hkv, d)[rest], kc1.view(-1, hkv, d)[rest]), tag
        else:  # the same roundings: the key written is the rope kernel's, bit for bit
            assert torch.equal(kc2.nan_to_num(), kc1.nan_to_num()), tag
        assert torch.equal(vc2.nan_to_num(), vc1.nan_to_num()), tag
    ref = paged_attention_ref(q1.double(), kc1.double(), vc1.double(), meta, p,
                              None if sk is None else sk.double())
    assert rel_err(got[live], ref[live]) < (1e-2 if dtype != torch.float32 else 1e-4), tag


def cases(n: int, seed: int) -> list[tuple]:
    """Random shapes over what the families need: GQA groups 1-8 (and a non-power of two),
    heads 64-256 (96: Phi-3), partial rotary, q/k norm with and without Gemma's offset, window,
    softcap, sinks, 1-16 segments, block sizes 16 / 32, keys ending on a tile edge (64, 128), and
    a graph's padded row (no KV write, its output unused)."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        hkv = rnd.choice([1, 2, 4])
        qpk = rnd.choice([1, 2, 3, 4, 8])
        d = rnd.choice([64, 96, 128, 256])
        rot = d if rnd.random() < 0.7 else d // 2
        S = rnd.choice([1, 1, 2, 3, 5])
        lens = [rnd.choice([1, 2, 63, 64, 65, 128, 129, rnd.randint(1, 300)]) for _ in range(S)]
        out.append((hkv * qpk, hkv, d, rot, rnd.choice([16, 32]), rnd.choice(["", "", "plain", "offset"]),
                    rnd.choice([None, None, 48]), rnd.choice([None, None, 30.0]), rnd.random() < 0.2,
                    rnd.choice([1, 2, 4, 16]), lens, S > 1 and rnd.random() < 0.3))
    return out


def run_all(device: str, dtypes: tuple, n: int) -> None:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    for dtype in dtypes:
        for c in cases(n, seed):
            one_case(device, dtype, *c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel needs CUDA")
def test_fused_decode_attention_cuda() -> None:
    torch.cuda.set_device(0)
    run_all("cuda", (torch.bfloat16, torch.float16, torch.float32), 12)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="test_fused_decode_attention_cuda runs these cases compiled here; the CUDA "
                           "image's Triton 3.6 interpreter cannot run unified_attention's loop bounds")
def test_fused_decode_attention_interpreter() -> None:
    """The same checks on the CPU under TRITON_INTERPRET=1: fp32 only (the interpreter's bf16
    dot is off by orders of magnitude for the unfused kernel too) and fewer cases (it runs each
    program in Python)."""
    code = ("import torch\nfrom tests.attention.test_decode_attention import run_all\n"
            "run_all('cpu', (torch.float32,), 16)\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
