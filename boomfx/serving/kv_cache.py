"""The engine's memory plan: weights, profiling peak, KV-cache bytes, blocks and concurrency.

Pure arithmetic on numbers the caller measured or predicted, in the order vLLM V1 computes them
(``boomfx/serving/engine.py`` for each source):

1. ``requested = device_bytes * gpu_memory_utilization``;
2. ``kv_available = requested - weights_per_rank - activation_peak - non_torch``;
3. per layer and block, ``page = block_size * kv_heads_per_rank * (head_dim + v_head_dim) * dtype_bytes``
   (``2 * block_size * kv_heads * head_dim * dtype_bytes`` when K and V heads are the same size);
4. ``num_blocks = kv_available // page // num_layers``; ``kv_tokens = num_blocks * block_size``;
5. ``max_concurrency = num_blocks / cdiv(max_model_len, block_size)``.

Steps 4-5 for models with sliding-window layers follow the engine's KV-cache groups
(``boomfx/serving/kv_groups.py``): layers per group instead of layers, blocks per request summed
over the groups, each sliding group holding only its window's blocks.

Example (Llama-2-7B, bf16, 32 layers, 32 KV heads of 128; block 16):
    >>> kv_bytes_per_token(32, 32, 128, 128, 2)   # 2 x 32 x 32 x 128 x 2
    524288
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from boomfx.serving.kv_groups import KVGroups, kv_groups


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_token(num_layers: int, kv_heads_per_rank: int, head_dim: int, v_head_dim: int,
                       dtype_bytes: int) -> int:
    """K and V of one token in every layer: ``layers x kv_heads x (head_dim + v_head_dim) x dtype_bytes``."""
    return num_layers * kv_heads_per_rank * (head_dim + v_head_dim) * dtype_bytes


def page_size_bytes(block_size: int, kv_heads_per_rank: int, head_dim: int, v_head_dim: int, dtype_bytes: int) -> int:
    """One block of one layer (vLLM's ``AttentionSpec.page_size_bytes``)."""
    return block_size * kv_heads_per_rank * (head_dim + v_head_dim) * dtype_bytes


def num_blocks(available_bytes: int, page_bytes: int, num_layers: int) -> int:
    """``available // page // layers``, never negative (vLLM's ``get_num_blocks``)."""
    return max(0, int(available_bytes) // page_bytes // num_layers)


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    return cdiv(max_model_len, block_size)


@dataclass(frozen=True)
class KVSpec:
    """The uniform per-layer KV-cache spec on one rank."""

    num_layers: int
    kv_heads: int                  # the model's
    kv_heads_per_rank: int
    head_dim: int
    v_head_dim: int
    dtype_bytes: int
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_heads_per_rank, self.head_dim, self.v_head_dim,
                                  self.dtype_bytes)

    @property
    def page_bytes(self) -> int:
        return page_size_bytes(self.block_size, self.kv_heads_per_rank, self.head_dim, self.v_head_dim,
                               self.dtype_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """The memory plan of one rank, as the engine computes it, and its verdict."""

    device_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    outside_baseline_bytes: int     # CUDA context: before the engine's baseline, must fit in the rest
    cudagraph_pool_bytes: int       # captured after the KV cache is allocated, outside the budget
    kv_available_bytes: int
    kv_bytes_per_token: int
    page_bytes: int
    num_blocks: int
    block_size: int
    kv_tokens: int
    max_model_len: int
    blocks_per_request: int
    max_concurrency: float
    fits: bool
    verdict: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    kv_groups: int = 1                       # the engine's KV-cache groups (block tables)
    layers_per_group: int = 0                # memory pools sharing the block pool
    sliding_layers: tuple[int, ...] = ()     # attention layers (0-based) whose cache keeps a window only
    sliding_windows: tuple[int, ...] = ()    # their windows, in tokens


def plan_memory(spec: KVSpec, device_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                activation_peak_bytes: int, non_torch_bytes: int, outside_baseline_bytes: int,
                cudagraph_pool_bytes: int, max_model_len: int, windows: Sequence[Optional[int]] = (),
                max_num_batched_tokens: int = 0, hybrid_kv_cache_manager: bool = True) -> MemoryPlan:
    """Steps 1-5 of the module docstring, and the engine's refusals in the order it checks them.

    ``windows``: each layer's sliding window (``None``: full attention; empty: all full);
    ``max_num_batched_tokens`` bounds what a sliding layer holds during a chunked prefill."""
    groups: KVGroups = kv_groups(tuple(windows) or (None,) * spec.num_layers, hybrid_kv_cache_manager)
    if len(groups.windows) != spec.num_layers:
        raise ValueError(f"{len(groups.windows)} layer windows for {spec.num_layers} layers")
    requested = int(device_bytes * gpu_memory_utilization)
    available = requested - weights_bytes - activation_peak_bytes - non_torch_bytes
    blocks = groups.num_blocks(available, spec.page_bytes)
    per_request = groups.blocks_per_request(max_model_len, max_num_batched_tokens, spec.block_size)
    concurrency = blocks / per_request
    needed_one = groups.needed_bytes(spec.page_bytes, max_model_len, max_num_batched_tokens, spec.block_size)
    gib = 1024 ** 3
    fits, verdict = True, "fits"
    if outside_baseline_bytes > device_bytes - requested:
        fits, verdict = False, (f"does not start: free memory after the CUDA context "
                                f"({(device_bytes - outside_baseline_bytes) / gib:.2f} GiB) is less than "
                                f"--gpu-memory-utilization x total ({requested / gib:.2f} GiB); lower it")
    elif available <= 0:
        fits, verdict = False, (f"does not fit: weights ({weights_bytes / gib:.2f} GiB) + profiling peak "
                                f"({activation_peak_bytes / gib:.2f} GiB) leave no memory for the KV cache within "
                                f"{requested / gib:.2f} GiB; raise --gpu-memory-utilization, use more GPUs or a "
                                "smaller --max-num-batched-tokens")
    elif needed_one > available:
        fits, verdict = False, (f"does not fit: one request of --max-model-len {max_model_len} needs "
                                f"{needed_one / gib:.2f} GiB of KV cache, more than the {available / gib:.2f} GiB "
                                "available; lower --max-model-len or raise --gpu-memory-utilization")
    elif requested + outside_baseline_bytes + cudagraph_pool_bytes > device_bytes:
        fits, verdict = False, (f"runs out of memory capturing CUDA graphs ({cudagraph_pool_bytes / gib:.2f} GiB "
                                "beyond the budget); lower --gpu-memory-utilization or use --enforce-eager")
    sliding = groups.sliding_layers
    return MemoryPlan(
        device_bytes=device_bytes, gpu_memory_utilization=gpu_memory_utilization, requested_bytes=requested,
        weights_bytes=weights_bytes, activation_peak_bytes=activation_peak_bytes, non_torch_bytes=non_torch_bytes,
        outside_baseline_bytes=outside_baseline_bytes, cudagraph_pool_bytes=cudagraph_pool_bytes,
        kv_available_bytes=max(0, available), kv_bytes_per_token=spec.bytes_per_token, page_bytes=spec.page_bytes,
        num_blocks=blocks, block_size=spec.block_size, kv_tokens=groups.kv_tokens(blocks, spec.block_size),
        max_model_len=max_model_len, blocks_per_request=per_request, max_concurrency=concurrency,
        fits=fits, verdict=verdict, kv_groups=len(groups.groups), layers_per_group=groups.group_size,
        sliding_layers=sliding, sliding_windows=tuple(groups.windows[i] for i in sliding))   # type: ignore[misc]
