"""Scratch memory of PyTorch's CPU flash attention, for memory predictions without a measured database.

``_scaled_dot_product_flash_attention_for_cpu`` (what SDPA runs on a CPU) works on blocks of ``q_split``
query rows against ``kv_split`` keys and allocates, inside the op, one fp32 block buffer per intra-op
thread: the forward ``q_split x kv_split`` scores, two row statistics and a ``q_split x head_dim`` output
block; the backward two score-sized blocks (attention and its gradient) and a row, plus a contiguous copy
of the output gradient when that is not laid out sequence-major (``(batch, seq, heads, dim)`` in memory,
the layout the kernel reads): the gradient a model's output projection hands back is (a transposed view of
``(batch, seq, heads * dim)``), so real training steps, eager and compiled, make no copy; a gradient made
contiguous in ``(batch, heads, seq, dim)`` order does. ``q_split`` is 32 query rows, 64 from 192 rows, 256 from
768 (never more than the query has), ``kv_split`` 512 keys (never more than the key has).

Why it matters: in a compiled training step the attention backward is where the peak often sits. The copy
is as large as the query: counting it for a sequence-major gradient put compiled Cohere and Gemma-3 steps
1.5-1.8% over their real peaks (the profiler shows the three gradients, a 32 KiB block and a 128 B row).

Measured (torch 2.13.0, fp32, profiler peak of one call minus its outputs; 1 and 2 threads; 16 shapes:
query rows 2-800, keys 31-800, head dims 32 and 64, causal, masked, GQA; each backward with its gradient in
both layouts): exact in every case (a single-row gradient is contiguous in both orders: no copy);
bf16/fp16 calls keep reduced-precision copies on top, not measured, and are left at 0.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

aten = torch.ops.aten
FORWARD_OPS = (aten._scaled_dot_product_flash_attention_for_cpu.default,)
BACKWARD_OPS = (aten._scaled_dot_product_flash_attention_for_cpu_backward.default,)
ACCUMULATE_BYTES = 4          # the blocks are fp32 whatever the inputs
KV_SPLIT = 512


def q_split(query_rows: int) -> int:
    """Query rows per block: ATen's choice by the query's length, never more than it has."""
    return min(query_rows, 256 if query_rows >= 768 else 64 if query_rows >= 192 else 32)


def attention_scratch_bytes(call: Any, threads: Optional[int] = None) -> int:
    """Bytes a CPU flash attention (forward or backward) allocates inside itself; 0 for other ops and for
    inputs other than fp32."""
    op = call.op
    if op not in FORWARD_OPS and op not in BACKWARD_OPS:
        return 0
    query, key = call.arg("query"), call.arg("key")
    if query is None or key is None or len(query.shape) != 4 or query.dtype != torch.float32:
        return 0
    try:
        batch, heads, rows, head_dim = (int(s) for s in query.shape)
        keys = int(key.shape[2])
    except TypeError:                 # symbolic sizes: priced once bound
        return 0
    threads = torch.get_num_threads() if threads is None else threads
    qs, kvs = q_split(rows), min(KV_SPLIT, keys)
    if op in FORWARD_OPS:
        per_thread = qs * kvs + 2 * qs + qs * head_dim
        return ACCUMULATE_BYTES * threads * per_thread
    grad_out = call.arg("grad_out")
    copy = 0 if grad_out is None or _sequence_major(grad_out) else math.prod(int(s) for s in grad_out.shape)
    return ACCUMULATE_BYTES * (copy + threads * (2 * qs * kvs + qs))


def _sequence_major(spec: Any) -> bool:
    """Whether a ``(batch, heads, seq, dim)`` tensor is contiguous in ``(batch, seq, heads, dim)`` order
    (a size-1 dimension's stride does not matter)."""
    try:
        shape, stride = [int(s) for s in spec.shape], [int(s) for s in spec.stride]
    except TypeError:
        return True
    expected = 1
    for d in (3, 1, 2, 0):
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True
