"""More than one device: tensor parallelism over torch.distributed process groups (gloo on the
CPU, NCCL on CUDA), engine-started worker ranks, multi-host rendezvous, data-parallel replicas.

group.py     rendezvous (TCPStore, missing ranks named on timeout) and TPGroup (the collectives)
parallel.py  the parallel layers (each owns its weight_loader) and shard_model
worker.py    the rank > 0 process: start-up in lockstep, then one forward per broadcast step
executor.py  rank 0's side: spawns the local workers, watches them, TPRunner broadcasts each step
"""
from __future__ import annotations

import os

# GPU hosts here must never use NVLink multicast (NVLS): set in every process the engine starts,
# before any NCCL communicator exists (children inherit the environment).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    os.environ.update(NO_MULTICAST)
