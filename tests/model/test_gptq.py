"""4-bit GPTQ / AWQ checkpoints (flatserve/model/gptq.py): the layouts unpacked to their codes, the
q4_g blocks bit-equal to the torch reference's dequantization (act-order permutation included),
and a random-weight checkpoint in each layout served through QuantLinear against the same
weights dequantized into a float checkpoint."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from flatserve.model import gptq
from flatserve.model.qformats import FORMATS, dequantize


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8C] codes -> int32 [R, C], value 8c + j in bits 4j."""
    v = q.to(torch.int64).reshape(q.shape[0], -1, 8) << (4 * torch.arange(8))
    return torch.from_numpy(v.sum(-1).numpy().astype(np.uint32).view(np.int32))


def pack(method: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor
         ) -> dict[str, torch.Tensor]:
    """codes [N, K], zeros [G, N] (true zero points), scales [G, N] -> checkpoint tensors."""
    if method == "gptq":
        return {"qweight": _pack_rows(q).t().contiguous(),  # [K/8, N]: value 8i + j of column n
                "qzeros": _pack_rows(z - 1), "scales": s, "g_idx": g_idx.to(torch.int32)}
    order = torch.tensor(gptq.AWQ_ORDER)
    qk = q.t().reshape(q.shape[1], -1, 8)[:, :, order].reshape(q.shape[1], -1)  # [K, N], AWQ order
    zk = z.reshape(z.shape[0], -1, 8)[:, :, order].reshape(z.shape[0], -1)
    return {"qweight": _pack_rows(qk), "qzeros": _pack_rows(zk), "scales": s}


def random_codes(n: int, k: int, group: int, act_order: bool, method: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    lo = 1 if method == "gptq" else 0  # GPTQ's files store zero - 1
    z = torch.randint(lo, lo + 16, (k // group, n), generator=g, dtype=torch.uint8)
    s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(torch.float16)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return q, z, s, g_idx


def _qc(method: str, group: int) -> dict:
    return gptq.config(type("C", (), {"quantization_config": {
        "quant_method": method, "bits": 4, "group_size": group, "desc_act": True, "version": "gemm"}})())


@pytest.mark.parametrize("method,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_layouts_unpack_and_blocks_are_the_references_bits(method, act_order, group) -> None:
    n, k = 48, 256
    q, z, s, g_idx = random_codes(n, k, group, act_order, method, seed=group)
    parts = pack(method, q, z, s, g_idx)
    uq, uz, us, ug = gptq.unpack(parts, _qc(method, group))
    assert torch.equal(uq, q) and torch.equal(uz, z) and torch.equal(us, s) and torch.equal(ug, g_idx)
    ref = gptq.reference(q, z, s, g_idx)  # [N, K]
    raw, perm = gptq.to_blocks(uq, uz, us, ug)
    assert (perm is not None) == act_order
    got = dequantize(raw, FORMATS["q4_g"], k)
    want = ref if perm is None else ref[:, perm]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_unsupported_configs_are_refused() -> None:
    assert gptq.config(type("C", (), {"quantization_config": {"quant_method": "mxfp4"}})()) is None
    for qc, msg in (({"quant_method": "gptq", "bits": 8, "group_size": 128}, "need 4 bits"),
                    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "multiple of 32"),
                    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM")):
        with pytest.raises(ValueError, match=msg):
            gptq.config(type("C", (), {"quantization_config": qc})())


def _quantize_linear(w: torch.Tensor, group: int, g_idx: torch.Tensor, method: str):
    """A plain min/max fit of w [N, K] per (row, group) -> codes, true zeros, scales."""
    n, k = w.shape
    G = k // group
    z = torch.empty(G, n, dtype=torch.uint8)
    s = torch.empty(G, n, dtype=torch.float16)
    q = torch.empty(n, k, dtype=torch.uint8)
    lo_z = 1 if method == "gptq" else 0
    for g in range(G):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols]
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        sc = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16)
        zz = torch.round(-lo / sc.float()).clamp(lo_z, 15 + lo_z)
        q[:, cols] = (torch.round(wg / sc.float()[:, None]) + zz[:, None]).clamp(0, 15).to(torch.uint8)
        z[g], s[g] = zz.to(torch.uint8), sc
    return q, z, s


def _checkpoints(tmp_path: Path, method: str, act_order: bool, family: str = "") -> tuple[Path, Path]:
    """A random Llama (tests/model/test_quant_fidelity.py's), or conftest's tiny `family`,
    quantized by _quantize_linear and packed in `method`'s layout (qdir), and the float
    checkpoint of its dequantized weights (ddir)."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import build_checkpoint
    from tests.model.test_quant_fidelity import _ckpt

    src = build_checkpoint(family, tmp_path)[0] if family else _ckpt(tmp_path)
    sd = load_file(str(src / "model.safetensors"))
    qdir, ddir = tmp_path / "q", tmp_path / "d"
    for d in (qdir, ddir):
        d.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
    qsd, dsd = {}, {}
    rng = torch.Generator().manual_seed(7)
    orders: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith("_proj.weight"):
            prefix, (_, k) = name[: -len(".weight")], t.shape
            # Linears reading one input (q|k|v, gate|up) share its act-order: GPTQ sorts by the
            # input's Hessian diagonal.
            proj = prefix.rsplit(".", 1)[1]
            key = prefix.rsplit(".", 1)[0] + (proj if proj in ("o_proj", "down_proj") else "")
            if key not in orders:
                g = torch.arange(k) // 64
                orders[key] = g[torch.randperm(k, generator=rng)] if act_order else g
            g_idx = orders[key]
            q, z, s = _quantize_linear(t, 64, g_idx, method)
            qsd.update({f"{prefix}.{p}": v for p, v in pack(method, q, z, s, g_idx).items()})
            dsd[name] = gptq.reference(q, z, s, g_idx).contiguous()
        else:
            qsd[name] = dsd[name] = t
    save_file(qsd, str(qdir / "model.safetensors"))
    save_file(dsd, str(ddir / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 64,
                                  "desc_act": act_order, "version": "gemm", "zero_point": True}
    (qdir / "config.json").write_text(json.dumps(cfg))

    return qdir, ddir


@pytest.mark.parametrize("method,act_order,family",
                         [("gptq", True, ""), ("awq", False, ""), ("gptq", False, "qwen2")])
def test_checkpoint_served_through_quantlinear(method, act_order, family, tmp_path: Path) -> None:
    """The quantized checkpoint through the reference path equals the float checkpoint of its
    dequantized weights (fp32 logits within 1e-4), and the kernel path agrees on the greedy
    tokens of a teacher-forced text. qwen2: random q|k|v biases beside the blocks (as
    Qwen2.5-GPTQ checkpoints carry), loaded into the fused QuantLinear's rows."""
    from flatserve.model import quant
    from tests.model.test_quant_fidelity import _fidelity, _llm, _logits_pair

    qdir, ddir = _checkpoints(tmp_path, method, act_order, family)
    ids = [random.Random(3).randrange(4, 512) for _ in range(256)]
    llm_q = _llm(str(qdir))
    model = llm_q.engine.runner.model
    assert set(quant.summary(model)) == {"q4_g", "dense"}  # the tied head stays float
    assert any(m.perm.numel() for m in model.modules() if isinstance(m, quant.QuantLinear)) == act_order
    if family:  # the biases sit on the fused q|k|v QuantLinear
        assert any(m.bias is not None for m in model.modules() if isinstance(m, quant.QuantLinear))
    ref_rows = [r for _, r in _logits_pair(llm_q, ids)]
    del llm_q
    llm_d = _llm(str(ddir))
    dense_rows = [r for _, r in _logits_pair(llm_d, ids)]
    err = max((a - b).abs().max().item() for a, b in zip(ref_rows, dense_rows))
    assert err < 1e-4, err
    agree, kl = _fidelity(_llm(str(qdir)), ids)
    assert agree >= 0.98 and kl <= 0.01, (agree, kl)


def test_tensor_parallel_keeps_the_blocks(tmp_path: Path) -> None:
    """TP=2 on the CPU (gloo): each rank cuts its q4_g rows and columns from the checkpoint's
    blocks (flatserve/distributed/quant_shards.py), so its tokens equal TP=1's but where TP=1's
    top two are within 1e-3, and a rank holds about half the blocks. Act-order (desc_act) stores
    o's and down's columns permuted, which do not split by rank: refused with that reason."""
    from flatserve import LLM, SamplingParams
    from tests.distributed.test_tensor_parallel import ENGINE, _margin_where_they_part, _prompts

    qdir, _ = _checkpoints(tmp_path, "awq", False)
    prompts = _prompts(random.randrange(1 << 30), n=4)
    runs = []
    for tp in (1, 2):
        with LLM(model=str(qdir), **{**ENGINE, "tensor_parallel_size": tp}) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True, logprobs=2), use_tqdm=False)
            runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                         {f: b for f, _, b in llm.engine.state.weight_formats}))
    (one, bytes1), (two, bytes2) = runs
    assert 0.4 * bytes1["q4_g"] < bytes2["q4_g"] < 0.6 * bytes1["q4_g"], (bytes1, bytes2)
    for (a, lps), (b, _) in zip(one, two):
        assert _margin_where_they_part(a, b, lps) < 1e-3, (a, b)
    act, _ = _checkpoints(tmp_path / "act", "gptq", True)
    with pytest.raises(Exception, match="act-order"):
        LLM(model=str(act), **{**ENGINE, "tensor_parallel_size": 2})
