"""Write the allocator model's state in the format of ``torch.cuda.memory._snapshot()``.

Why: the same pickle opens in PyTorch's memory viewer (pytorch.org/memory_viz) and in
``torch.cuda._memory_viz`` (``segsum``, ``trace``, ``segments``), so a predicted layout can be inspected with
the tools users already know. Keys follow the TypedDicts in ``torch/cuda/memory.py`` (Snapshot, Segment,
Block, Frame, TraceEntry) of the installed torch; each frame list starts with a frame naming the fx node.

Example:
    >>> from boomfx.memory.config import AllocatorConfig, MiB
    >>> from boomfx.memory.allocator import CachingAllocator
    >>> a = CachingAllocator(AllocatorConfig(), 1024 * MiB, record_trace=True)
    >>> _ = a.malloc(3 * MiB, label="linear")
    >>> s = snapshot(a)
    >>> s["segments"][0]["total_size"] // MiB, s["device_traces"][0][-1]["action"]
    (20, 'alloc')
"""
from __future__ import annotations

import os
import pickle
from typing import Optional, Sequence, Union

from boomfx.memory.allocator import CachingAllocator, frames_to_dicts


def _allocator_settings(alloc: CachingAllocator) -> dict:
    cfg = alloc.config
    return {
        "PYTORCH_CUDA_ALLOC_CONF": cfg.conf_string,
        "max_split_size": -1 if cfg.max_split_is_unlimited else cfg.max_split_size_bytes,
        "garbage_collection_threshold": cfg.garbage_collection_threshold,
        "expandable_segments": cfg.expandable_segments,
        "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(cfg.roundup_power2_divisions)},
    }


def snapshot(allocator: CachingAllocator, trace: Optional[Sequence[dict]] = None) -> dict:
    """The allocator's segments and trace as a ``torch.cuda.memory._snapshot()`` dictionary.

    Args:
        allocator: the model whose current state is dumped.
        trace: TraceEntry dicts; defaults to ``allocator.trace`` (filled when ``record_trace=True``).
    """
    segments = []
    for seg in allocator.segments():
        blocks = [{"address": b.address, "size": b.size, "requested_size": b.requested_size, "state": b.state,
                   "frames": frames_to_dicts(b.label, b.frames)} for b in seg.blocks]
        segments.append({
            "device": 0,
            "address": seg.address,
            "total_size": seg.total_size,
            "allocated_size": seg.allocated_size,
            "active_size": seg.allocated_size,  # no record_stream in the model: active == allocated
            "requested_size": seg.requested_size,
            "stream": seg.stream,
            "segment_type": seg.segment_type,
            "segment_pool_id": (0, 0),
            "is_expandable": seg.is_expandable,
            "frames": frames_to_dicts(seg.label, seg.frames),
            "blocks": blocks,
        })
    entries = list(allocator.trace if trace is None else trace)
    return {"segments": segments, "device_traces": [entries], "allocator_settings": _allocator_settings(allocator)}


def write_snapshot(path: Union[str, "os.PathLike[str]"], allocator: CachingAllocator,
                   trace: Optional[Sequence[dict]] = None) -> dict:
    """Pickle ``snapshot(allocator, trace)`` to ``path`` as ``torch.cuda.memory._dump_snapshot`` does."""
    data = snapshot(allocator, trace)
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return data
