"""Replays the parity tests' preempt mode through the scheduler alone (no model): for how many
seeds do the 8 prompts never preempt? (tests/model/test_parity.py, test_moe_parity.py and
tests/distributed/test_tensor_parallel.py assert a preemption.)

    .venv/bin/python benchmarks/dev/preempt_replay.py [--seeds 20000]

Pool: 30 blocks of 16 tokens (block 0 reserved), max_model_len 400, as in those tests.
"""
import argparse
import sys

sys.path.insert(0, ".")

from flatserve.engine.kv_manager import KVCacheManager  # noqa: E402
from flatserve.engine.request import Request  # noqa: E402
from flatserve.engine.sampling_params import SamplingParams  # noqa: E402
from flatserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tests.distributed.test_tensor_parallel import _prompts as tp_prompts  # noqa: E402
from tests.model.test_parity import _prompts  # noqa: E402


def preemptions(prompts: list[list[int]], budget: int, new: int) -> int:
    s = Scheduler(SchedulerConfig(256, budget, 400), KVCacheManager(30, 16, enable_caching=False))
    for i, p in enumerate(prompts):
        s.add_request(Request(str(i), p, SamplingParams(max_tokens=new, ignore_eos=True), new))
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, {x.request.request_id: [5] for x in out.scheduled if x.samples})
    return s.num_preemptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20000)
    n = ap.parse_args().seeds
    cases = [("tensor parallel: budget 48, 24 new", 48, 24, tp_prompts),
             ("parity: budget 4096, 32 new", 4096, 32, lambda s: _prompts(s, max_len=100, min_len=60)),
             ("24 new (the MoE test before 71e1782)", 4096, 24, lambda s: _prompts(s, max_len=100, min_len=60))]
    for name, budget, new, make in cases:
        zero = [sd for sd in range(n) if preemptions(make(sd), budget, new) == 0]
        print(f"{name}: {len(zero)} of {n} seeds without a preemption {zero[:5]}")


if __name__ == "__main__":
    main()
