"""Scratch memory of PyTorch's CPU flash attention, for memory predictions without a measured database.

``_scaled_dot_product_flash_attention_for_cpu`` (what SDPA runs on a CPU) works on blocks of ``q_split``
query rows against ``kv_split`` keys and allocates, inside the op, one fp32 block buffer per intra-op
thread: the forward ``q_split x kv_split`` scores, two row statistics and a ``q_split x head_dim`` output
block; the backward two score-sized blocks (attention and its gradient) and a row, plus an fp32 buffer of
the query gradient's size that it accumulates into. ``q_split`` is 32 query rows, 64 from 192 rows, 256 from
768 (never more than the query has), ``kv_split`` 512 keys (never more than the key has).

Why it matters: the backward's buffer is as large as the query; in a compiled training step the attention
backward is where the peak sits (a compiled Cohere step's predicted peak was 557 KiB, 1.9%, under the real
step's without it).

Measured (torch 2.13.0, fp32, profiler peak of one call minus its outputs; 1 and 2 threads; 16 shapes:
query rows 2-800, keys 31-800, head dims 32 and 64, causal, masked, GQA): exact in every case but one, a
single-row backward (decode), which allocates no query-sized buffer (2.3 KiB measured); bf16/fp16 calls
keep reduced-precision copies on top, not measured, and are left at 0.
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
    query_gradient = math.prod((batch, heads, rows, head_dim)) if rows > 1 else 0
    return ACCUMULATE_BYTES * (query_gradient + threads * (2 * qs * kvs + qs))
