"""The split-KV rule that decode graphs and eager decode steps share (no GPU needed): a graph
captured for a batch bucket and an eager step of any batch that replays it must split KV alike,
or their tokens differ in the last bits (tests/test_cuda_e2e.py checks the tokens on CUDA)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the attention kernels' module needs triton")


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 13, 16, 20, 64, 100, 256])
def test_an_eager_batch_splits_as_the_graph_it_would_replay(max_num_seqs: int) -> None:
    from flatserve.attention.kernels.unified_attention import decode_bucket, fill_segments
    from flatserve.graphs import capture_sizes

    sizes = capture_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        graph = next(b for b in sizes if b >= n)  # DecodeGraphs.bucket
        # capture sees num_seqs = graph; an eager step of n sequences sees n
        assert decode_bucket(graph) == decode_bucket(n), (max_num_seqs, n, graph)
        for heads, sms in ((1, 132), (8, 132), (2, 78)):
            eager = fill_segments(decode_bucket(n), heads, sms)
            assert fill_segments(decode_bucket(graph), heads, sms) == eager, (max_num_seqs, n, heads)


def test_one_sequence_on_an_h100_splits_kv() -> None:
    from flatserve.attention.kernels.unified_attention import SPLIT_TARGET, fill_segments

    s = fill_segments(1, 8, 132)  # 8 programs unsplit, on 132 SMs
    assert s > 1 and s & (s - 1) == 0 and 8 * s >= min(SPLIT_TARGET * 132, 8 * 16)
    assert fill_segments(64, 8, 132) == 1  # 512 programs already fill the SMs
