"""NCCL's device memory outside the caching allocator: one set of channel buffers per communicator.

Why: every process group a rank joins (its ``dp_shard``, ``dp_replicate``, ``tp`` and ``pp`` groups)
gets an NCCL communicator, and each communicator allocates its channels' receive buffers (per
connection: the LL, LL128 and SIMPLE protocols' FIFOs, about 9.2 MiB at NCCL's default
``NCCL_BUFFSIZE`` of 4 MiB) with ``cudaMalloc``/``cuMem`` directly, so ``torch.cuda.memory_reserved``
never shows them, yet they take device memory: a rank that fits in the allocator's view can still
run out.

The sizes are measured, not derived (the channel count and which algorithms connect depend on the
topology and NCCL version): NVIDIA/nccl issue #964 (4 x A100 with NVLink, PyTorch, one 4 MB
all-reduce on every process group): 544 MB per communicator of 2 ranks, 688 MB per communicator of
more. A point-to-point pipeline group connects only neighbours: its communicator is taken as a
2-rank one. Not modelled: NVLink SHARP buffers on NVSwitch systems (H100/H200/B200 with NVLS
enabled: more), network transports between nodes, ``NCCL_BUFFSIZE`` or channel overrides. A user
who measured their own (``nvidia-smi`` minus ``torch.cuda.memory_reserved()`` minus the CUDA
context) gives ``--outside-memory nccl=<total>``, which replaces this estimate.
"""

from __future__ import annotations

from boomfx.distributed.plan import ParallelConfig

MB = 1000 * 1000
NCCL_COMMUNICATOR_TWO_RANKS_BYTES = 544 * MB   # nccl#964: 2-GPU process group, A100 NVLink
NCCL_COMMUNICATOR_MORE_RANKS_BYTES = 688 * MB  # nccl#964: 3- and 4-GPU process groups
_GROUPS = ("dp_replicate", "dp_shard", "tp", "pp")


def communicators(cfg: ParallelConfig) -> list[tuple[str, int]]:
    """(mesh dimension, ranks) of every NCCL communicator one rank joins: its groups of more than one rank."""
    return [(name, getattr(cfg, name)) for name in _GROUPS if getattr(cfg, name) > 1]


def communicator_bytes(name: str, ranks: int) -> int:
    """Device memory NCCL holds for one communicator (see the module docstring)."""
    if ranks == 2 or name == "pp":
        return NCCL_COMMUNICATOR_TWO_RANKS_BYTES
    return NCCL_COMMUNICATOR_MORE_RANKS_BYTES


def nccl_outside_bytes(cfg: ParallelConfig) -> int:
    """NCCL's memory outside the allocator on one rank of ``cfg`` (0 on gloo: host memory)."""
    if cfg.backend != "nccl":
        return 0
    return sum(communicator_bytes(name, ranks) for name, ranks in communicators(cfg))


def with_nccl_memory(outside_memory: str, cfg: ParallelConfig) -> str:
    """``--outside-memory`` with NCCL's estimate added, unless the user gave ``nccl=`` themselves."""
    items = [p.strip() for p in outside_memory.split(",") if p.strip()]
    if any(p.partition("=")[0].strip() == "nccl" for p in items):
        return outside_memory
    nbytes = nccl_outside_bytes(cfg)
    return ",".join(items + [f"nccl={nbytes}"]) if nbytes else outside_memory
