"""The AMX prefill kernel (long runs of rows over paged KV) against the float64 torch reference,
on fresh random inputs. bf16 in and out: the kernel rounds P to bf16 before P V (as flash
kernels do) and the output once, so it agrees to ~2e-3 relative; the bar is 1e-2, the decode
kernel's bf16 bar. A wrong mask or a misplaced tile gives errors of order 1."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve.attention import cpu_backend
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.torch_backend import TorchAttentionBackend, paged_attention_ref
from tests.attention.cases import make_case, rel_err
from tests.conftest import require_kernel



@pytest.fixture(autouse=True)
def _at_amx(amx_isa: str) -> None:
    """The prefill kernel exists at the amx level only (conftest.amx_isa skips elsewhere)."""
    require_kernel(cpu_backend.kernel)
    require_kernel(cpu_backend.prefill_kernel)
    assert cpu_backend.prefill_available(), "AMX tile state not granted by the OS"


def check(q_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int,
          window: int | None, bs: int = 16) -> None:
    q, kc, vc, meta = make_case(q_lens, seq_lens, hq, hkv, d, bs, torch.bfloat16, device="cpu")
    p = LayerAttnParams(d ** -0.5, window)
    out = cpu_backend.paged_prefill(q, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q, p)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), meta, p)
    err = rel_err(out, ref)
    assert out.dtype == torch.bfloat16 and err < 1e-2, f"rel err {err:.2e}"
    # Row by row too: one bad row among thousands hides in a norm over all of them.
    worst = ((out.double() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max().item()
    assert worst < 3e-2, f"worst row rel err {worst:.2e}"


@pytest.mark.parametrize("window", [None, 1, 16, 100, 512])
def test_prompts_and_continuing_chunks(window: int | None) -> None:
    """Whole prompts from position 0 and chunks after a context, ragged, Gemma's shape."""
    q_lens = [random.randint(17, 300) for _ in range(5)] + [1, 2, 600]
    seq_lens = [n + random.choice([0, random.randint(1, 700)]) for n in q_lens]
    check(q_lens, seq_lens, 4, 1, 256, window)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 8), (6, 2), (32, 1), (28, 4)])
def test_gqa_ratios(hq: int, hkv: int) -> None:
    """Groups of 1..32 query heads per KV head: 32 // g tokens per 32-row work item, so g = 3
    and 7 leave rows of the last tile unused."""
    q_lens = [random.randint(17, 200) for _ in range(4)]
    check(q_lens, [n + random.randint(0, 300) for n in q_lens], hq, hkv, 64, random.choice([None, 50]))


@pytest.mark.parametrize("d,bs", [(32, 16), (128, 32), (256, 8), (96, 16)])
def test_head_and_block_sizes(d: int, bs: int) -> None:
    q_lens = [random.randint(17, 260) for _ in range(3)]
    check(q_lens, [n + random.randint(0, 400) for n in q_lens], 8, 2, d, None, bs)


def test_long_contexts_in_batches() -> None:
    """Chunks after 4,000-token contexts: 8 MB of packed K+V each, so the kernel packs and runs
    the sequences in several batches (32 MB each) and must keep each one's rows and keys apart."""
    check([17, 40, 17, 25, 17, 17, 30, 17], [4000 + random.randint(0, 90) for _ in range(8)],
          4, 2, 256, random.choice([None, 700]))


def test_refuses_what_it_cannot_run() -> None:
    q, kc, vc, meta = make_case([20], [20], 4, 1, 48, 16, torch.bfloat16, device="cpu")
    p = LayerAttnParams(0.1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_backend.paged_prefill(q, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q, p)
    q, kc, vc, meta = make_case([20], [20], 4, 1, 64, 16, torch.bfloat16, device="cpu")
    with pytest.raises(RuntimeError, match="span"):
        cpu_backend.paged_prefill(q, kc, vc, meta.block_table, meta.seq_lens,
                                  torch.tensor([0, 19], dtype=torch.int32), p)
    with pytest.raises(RuntimeError, match="1..seq_len rows"):
        cpu_backend.paged_prefill(q, kc, vc, meta.block_table, torch.tensor([19], dtype=torch.int32),
                                  meta.cu_seqlens_q, p)
    assert not cpu_backend.prefill_fits(q.float(), kc.float(), p, None)
    assert not cpu_backend.prefill_fits(q, kc, LayerAttnParams(0.1, None, 30.0), None)
    assert not cpu_backend.prefill_fits(q, kc, p, torch.zeros(4))
    assert cpu_backend.prefill_fits(q, kc, p, None)


@pytest.mark.parametrize("q_lens", [
    [1, 37, 1, 4, 1, 120],  # decodes and a verify run beside prefill chunks
    [300, 17],  # prefill chunks only: the kernel gets the step's own rows
])
@pytest.mark.parametrize("window", [None, 64])
def test_backend_mixed_batch(q_lens: list[int], window: int | None) -> None:
    """The "cpu" backend (decode kernel + AMX prefill) against the "cpu-sdpa" one and the torch
    backend on one bf16 step: the same KV written, outputs within bf16 rounding of each other."""
    seq_lens = [n + random.randint(0, 500) for n in q_lens]
    q, kc, vc, meta = make_case(q_lens, seq_lens, 8, 2, 64, 16, torch.bfloat16, device="cpu")
    k = torch.randn(q.shape[0], 2, 64).bfloat16()
    v = torch.randn(q.shape[0], 2, 64).bfloat16()
    p = LayerAttnParams(64 ** -0.5, window)
    caches = [(kc.clone(), vc.clone()) for _ in range(3)]
    outs = [b.forward(q, k, v, *c, meta, p) for b, c in zip(
        (cpu_backend.CpuAttentionBackend(), cpu_backend.CpuSdpaPrefillBackend(),
         TorchAttentionBackend()), caches)]
    assert all(torch.equal(c[0], caches[2][0]) and torch.equal(c[1], caches[2][1]) for c in caches)
    ref = paged_attention_ref(q.double(), caches[2][0].double(), caches[2][1].double(), meta, p)
    for out in outs:
        assert rel_err(out, ref) < 1e-2
    assert rel_err(outs[0], outs[1]) < 1e-2


def test_whole_model_as_close_to_fp32_as_sdpa(tmp_path, monkeypatch) -> None:
    """A bf16 Gemma 3 checkpoint (window 64, shorter than the prompts) with prompts chunked by a
    small token budget: first-token logprobs through the AMX prefill kernel are no further from
    the fp32 engine than those through SDPA, up to the one extra rounding the kernel makes.

    Why the bound: both bf16 runs round the same weights and the attention output once; the
    kernel also rounds P to bf16 before P V, a relative error of at most 2^-9 per weight, the
    size of the output rounding both already make. So its gap is at most about twice SDPA's,
    plus an additive floor (1e-2) for the order of sums, which moves with the thread count
    (seeded prompts: the inputs are fixed, only the threads vary between machines)."""
    from flatserve import LLM, SamplingParams
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint("gemma3", tmp_path)
    rng = random.Random(20261125)
    prompts = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(17, 200))]}
               for _ in range(6)]
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5, ignore_eos=True)
    calls = []
    inner = cpu_backend.paged_prefill
    monkeypatch.setattr(cpu_backend, "paged_prefill",
                        lambda *a, **kw: calls.append(1) or inner(*a, **kw))
    runs = {}
    for name, kw in (("fp32", dict(dtype="float32", attention_backend="torch")),
                     ("sdpa", dict(dtype="bfloat16", attention_backend="cpu-sdpa")),
                     ("amx", dict(dtype="bfloat16", attention_backend="cpu"))):
        llm = LLM(model=str(path), device="cpu", max_model_len=256, max_num_batched_tokens=96, **kw)
        runs[name] = [o.outputs[0].logprobs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert bool(calls) == (name == "amx")
        del llm

    def worst(name: str) -> float:
        return max(abs(a[t].logprob - b[t].logprob)
                   for a, b in zip(runs[name], runs["fp32"]) for t in set(a) & set(b))

    assert worst("amx") <= 2 * worst("sdpa") + 1e-2


def test_prefill_writes_only_its_sequences() -> None:
    check_writes_only_their_sequences("prefill")


def check_writes_only_their_sequences(which: str) -> None:
    """With `seqs`, a kernel reads its sequences' rows of the whole step's q and writes exactly
    those rows of `out`: each equals the kernel run on that sequence alone, the other rows keep
    what was there (how a mixed step sends decodes and chunks to their kernels without copies)."""
    q_lens = [1, 40, 3, 1, 70, 2] if which == "decode" else [1, 40, 3, 1, 70, 2, 33]
    seq_lens = [n + random.randint(0, 300) for n in q_lens]
    q, kc, vc, meta = make_case(q_lens, seq_lens, 8, 2, 64, 16, torch.bfloat16, device="cpu")
    p = LayerAttnParams(64 ** -0.5, random.choice([None, 48]))
    cu = meta.cu_seqlens_q_host
    mine = [s for s in range(len(q_lens)) if (q_lens[s] <= 16) == (which == "decode")]
    seqs = torch.tensor(mine, dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    if which == "decode":
        cpu_backend.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p, None,
                                 meta.cu_seqlens_q, seqs, out)
    else:
        cpu_backend.paged_prefill(q, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                                  p, seqs, out)
    for s in range(len(q_lens)):
        rows = slice(cu[s], cu[s + 1])
        if s not in mine:
            assert bool((out[rows] == 7.0).all()), f"sequence {s}'s rows were written"
            continue
        one = torch.tensor([0, q_lens[s]], dtype=torch.int32)
        args = (q[rows], kc, vc, meta.block_table[s:s + 1], meta.seq_lens[s:s + 1])
        alone = (cpu_backend.paged_decode(*args, p, None, one) if which == "decode"
                 else cpu_backend.paged_prefill(*args, one, p))
        assert torch.equal(out[rows], alone), f"sequence {s} differs from its run alone"


@pytest.mark.parametrize("hq,hkv,d,window", [(4, 1, 256, None), (8, 2, 64, None), (6, 2, 128, 40)])
def test_rows_do_not_depend_on_the_chunking(hq: int, hkv: int, d: int, window: int | None) -> None:
    """A prompt's rows give the same bits whole, cut into random chunks, or as a prefix-cache
    tail beside other sequences: chunked prefill and prefix caching must not change answers."""
    L = random.randint(40, 300)
    q, kc, vc, meta = make_case([L], [L], hq, hkv, d, 16, torch.bfloat16, device="cpu")
    p = LayerAttnParams(d ** -0.5, window)
    whole = cpu_backend.paged_prefill(q, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q, p)
    cuts = sorted(random.sample(range(1, L), 3))
    for a, b in zip([0] + cuts, cuts + [L]):  # each chunk alone: rows a..b-1 ending at b
        part = cpu_backend.paged_prefill(q[a:b], kc, vc, meta.block_table, torch.tensor([b], dtype=torch.int32),
                                         torch.tensor([0, b - a], dtype=torch.int32), p)
        assert torch.equal(part, whole[a:b]), f"rows {a}..{b} of {L} differ from the whole prompt's"

