"""Attention kernel timings on the GPU, against measured ceilings and a padded-SDPA peer.

    PYTHONPATH=. python3 benchmarks/attention_kernels.py [--out docs/benchmarks/kernels.json]
        [--timer events|do_bench]

Per case: median time (CUDA events, warm, inputs rotated over 4 copies so L2 does not hold
them; `--timer` in benchmarks/common.py's gpu_ms: `events` puts a GPU spin before each call,
`do_bench`, the harness before 2026-11-19, a 256 MB memset whose dirty lines the timed kernel
writes back), KV bytes actually needed / time, attention FLOPs / time,
and the same case through torch SDPA on padded [S, H, L_max, D] copies (a padded-cache peer).

Runtime (estimate, not timed): a few minutes on one H100/H200 for all 14 cases with the SDPA
and Flex peers; `--cases` and `--no-sdpa` cut it.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import BS, CASES, DT, D, gpu_ms  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from flatserve.attention.kernels.unified_attention import unified_attention  # noqa: E402
from tests.attention.test_kernels import make_case  # noqa: E402

TIMER = "events"  # --timer


def ceilings() -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = gpu_ms(lambda: y.copy_(x), TIMER)
    a = torch.randn(8192, 8192, dtype=DT, device="cuda")
    b = torch.randn(8192, 8192, dtype=DT, device="cuda")
    tm = gpu_ms(lambda: a @ b, TIMER)
    return {"copy_GBps": 2 * x.numel() / t / 1e6, "matmul_TFLOPs": 2 * 8192**3 / tm / 1e9}


def costs(q_lens: list[int], seq_lens: list[int], hq: int, hkv: int) -> tuple[int, int]:
    kv_bytes = sum(seq_lens) * hkv * D * 2 * 2  # K and V, bf16, each needed token read once
    flops = 0
    for n, L in zip(q_lens, seq_lens):
        for j in range(n):
            flops += 4 * hq * D * (L - n + j + 1)  # QK^T and PV over the visible keys
    return kv_bytes, flops


def padded_sdpa(q_lens, seq_lens, hq, hkv, sets):
    """The padded-cache peer: K/V copied into [S, Hkv, L_max, D] (copy not timed), masked SDPA."""
    S, Lm, Qm = len(seq_lens), max(seq_lens), max(q_lens)
    mask = torch.zeros(S, 1, Qm, Lm, dtype=torch.bool, device="cuda")
    for i, (n, L) in enumerate(zip(q_lens, seq_lens)):
        qp = torch.arange(L - n, L, device="cuda")[:, None]
        mask[i, 0, :n, :L] = torch.arange(L, device="cuda")[None, :] <= qp
    mask[:, :, :, 0] = True  # padded query rows see one key (no NaN)
    padded = []
    for q, kc, vc, meta in sets:
        qq = torch.zeros(S, hq, Qm, D, dtype=DT, device="cuda")
        kk = torch.zeros(S, hkv, Lm, D, dtype=DT, device="cuda")
        vv = torch.zeros_like(kk)
        for i, (n, L) in enumerate(zip(q_lens, seq_lens)):
            c0 = meta.cu_seqlens_q_host[i]
            qq[i, :, :n] = q[c0:c0 + n].transpose(0, 1)
            blocks = meta.block_table[i, : -(-L // BS)].long()
            kk[i, :, :L] = kc[blocks].flatten(0, 1)[:L].transpose(0, 1)
            vv[i, :, :L] = vc[blocks].flatten(0, 1)[:L].transpose(0, 1)
        padded.append((qq, kk, vv))
    return padded, mask


def bench_case(name, q_lens, seq_lens, hq, hkv, ceil, peer: bool = True, flex: bool = False) -> dict:
    sets = [make_case(q_lens, seq_lens, hq, hkv, D, BS, DT) for _ in range(4)]
    p = LayerAttnParams(D ** -0.5)
    outs = [torch.empty_like(s[0]) for s in sets]
    i = [0]

    def run() -> None:
        k = i[0] = (i[0] + 1) % 4
        q, kc, vc, meta = sets[k]
        unified_attention(q, kc, vc, meta, p, out=outs[k])

    t = gpu_ms(run, TIMER)  # ms
    # The alternative: a host-built q-block -> sequence map instead of the in-kernel binary search.
    from flatserve.attention.kernels.unified_attention import build_seq_map, tile_config

    bm = tile_config(sets[0][3], hq // hkv, D)[0]
    maps = [torch.tensor(build_seq_map(m, bm // (hq // hkv)), dtype=torch.int32, device="cuda")
            for *_, m in sets]

    def run_map() -> None:
        k = i[0] = (i[0] + 1) % 4
        q, kc, vc, meta = sets[k]
        unified_attention(q, kc, vc, meta, p, out=outs[k], seq_map=maps[k])

    t_map = gpu_ms(run_map, TIMER)
    kv, fl = costs(q_lens, seq_lens, hq, hkv)
    row = {"case": name, "us": t * 1e3, "map_us": t_map * 1e3, "kv_TBps": kv / t / 1e9, "TFLOPs": fl / t / 1e9,
           "floor_us": max(kv / (ceil["copy_GBps"] * 1e9), fl / (ceil["matmul_TFLOPs"] * 1e12)) * 1e6}
    if flex:
        row.update(flex_case(sets, p, i))
    if not peer:
        return row
    try:
        padded, mask = padded_sdpa(q_lens, seq_lens, hq, hkv, sets)
        F = torch.nn.functional

        def run_sdpa() -> None:
            k = i[0] = (i[0] + 1) % 4
            qq, kk, vv = padded[k]
            F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)

        row["sdpa_padded_us"] = gpu_ms(run_sdpa, TIMER) * 1e3
    except torch.OutOfMemoryError:
        row["sdpa_padded_us"] = None
    return row


def flex_case(sets, p: LayerAttnParams, i) -> dict:
    """FlexAttention over the same paged caches (benchmarks/flex_peer.py); its error vs ours."""
    from benchmarks.flex_peer import make_flex_runner

    try:
        runners = [make_flex_runner(q, kc, vc, meta, p.scale) for q, kc, vc, meta in sets]
        q, kc, vc, meta = sets[0]
        ours = unified_attention(q, kc, vc, meta, p).float()
        theirs = runners[0][1](runners[0][0]()).float()
        err = ((theirs - ours).norm() / ours.norm()).item()

        def run_flex() -> None:
            k = i[0] = (i[0] + 1) % 4
            runners[k][0]()

        t = gpu_ms(run_flex, TIMER)
        return {"flex_us": t * 1e3, "flex_rel_err": err}
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is reported, not fatal
        return {"flex_us": None, "flex_error": f"{type(e).__name__}: {str(e)[:300]}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out/kernels.json")
    ap.add_argument("--cases", default="", help="comma-separated substrings; empty = all")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention over the paged cache")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--timer", choices=["events", "do_bench"], default="events")
    a = ap.parse_args()
    global TIMER
    TIMER = a.timer
    ceil = ceilings()
    print(f"GPU: {torch.cuda.get_device_name()}  timer {TIMER}  copy {ceil['copy_GBps']:.0f} GB/s (read+write)  "
          f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s")
    want = [w for w in a.cases.split(",") if w]
    rows = []
    for c in CASES:
        if want and not any(w in c[0] for w in want):
            continue
        rows.append(bench_case(*c, ceil, peer=not a.no_sdpa, flex=a.flex))
        print(json.dumps(rows[-1]), flush=True)
    print("| case | flatserve us | host-map us | KV TB/s | TFLOP/s | floor us | SDPA padded us | Flex paged us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        sd = f"{r['sdpa_padded_us']:.1f}" if r.get("sdpa_padded_us") else "OOM/skipped"
        fx = f"{r['flex_us']:.1f}" if r.get("flex_us") else r.get("flex_error", "-")[:60]
        print(f"| {r['case']} | {r['us']:.1f} | {r['map_us']:.1f} | {r['kv_TBps']:.2f} | {r['TFLOPs']:.1f} | "
              f"{r['floor_us']:.1f} | {sd} | {fx} |")
    import os

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "timer": TIMER, "ceilings": ceil, "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    main()
