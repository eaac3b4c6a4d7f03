"""NCCL's channel buffers outside the caching allocator, one measured-typical amount per communicator."""
from __future__ import annotations

import json
from pathlib import Path

from boomfx.cli.main import main
from boomfx.distributed.nccl_memory import (
    NCCL_COMMUNICATOR_MORE_RANKS_BYTES,
    NCCL_COMMUNICATOR_TWO_RANKS_BYTES,
    communicators,
    nccl_outside_bytes,
    with_nccl_memory,
)
from boomfx.distributed.plan import ParallelConfig

TINY = str(Path(__file__).resolve().parents[1] / "examples" / "llama_tiny.pt2")


def test_one_buffer_set_per_group_the_rank_joins() -> None:
    cfg = ParallelConfig(dp_replicate=2, dp_shard=4, tp=2, pp=2, microbatches=2)
    # the rank's groups: replicate (2 ranks), shard (4), tp (2), pp (neighbours only)
    assert communicators(cfg) == [("dp_replicate", 2), ("dp_shard", 4), ("tp", 2), ("pp", 2)]
    assert nccl_outside_bytes(cfg) == 3 * 544_000_000 + 688_000_000
    assert NCCL_COMMUNICATOR_TWO_RANKS_BYTES == 544_000_000 and NCCL_COMMUNICATOR_MORE_RANKS_BYTES == 688_000_000
    assert nccl_outside_bytes(ParallelConfig(dp_shard=8)) == 688_000_000
    assert nccl_outside_bytes(ParallelConfig(dp_shard=8, backend="gloo")) == 0   # gloo's buffers are host memory
    # the user's own measurement wins
    assert with_nccl_memory("cuda_context=600MiB,nccl=1GiB", ParallelConfig(dp_shard=8)) == "cuda_context=600MiB,nccl=1GiB"
    assert with_nccl_memory("cuda_context=600MiB", ParallelConfig(dp_shard=8)) == "cuda_context=600MiB,nccl=688000000"


def _outside(capsys, *extra: str) -> dict:
    code = main(["analyze", TINY, "--train", "--batch", "2", "--seq", "64", "--device", "h100-sxm",
                 "--parallel", "dp_shard=4,tp=2", "--json", "-", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    memory = json.loads(out)["memory"]
    return memory


def test_report_counts_nccl_against_the_device(capsys) -> None:
    memory = _outside(capsys)
    assert memory["outside_allocator_bytes"]["nccl"] == 688_000_000 + 544_000_000   # dp_shard=4, tp=2
    overridden = _outside(capsys, "--outside-memory", "nccl=0")
    assert overridden["outside_allocator_bytes"]["nccl"] == 0
    # the device total carries it: the two reports differ by exactly NCCL's bytes
    assert memory["total_device_bytes"] - overridden["total_device_bytes"] == 1_232_000_000


def test_outside_memory_beyond_the_device_does_not_fit(capsys) -> None:
    """NCCL's buffers (or a user's figure) larger than the device leave the allocator nothing: the rank
    does not fit, and the report still says what the step itself needs (was a traceback: a negative
    capacity handed to the allocator model)."""
    memory = _outside(capsys, "--outside-memory", "nccl=100GiB")
    assert memory["fits"] is False
    assert memory["allocator"]["peak_reserved_bytes"] > 0
    assert memory["total_device_bytes"] == (memory["allocator"]["peak_reserved_bytes"] + 100 * 2**30
                                            + memory["outside_allocator_bytes"]["cuda_context"])
