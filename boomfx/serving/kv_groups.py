"""vLLM V1's KV-cache groups: how sliding-window layers change the blocks a request needs.

Read in vLLM's source (``vllm/v1/kv_cache_interface.py``, ``vllm/v1/core/kv_cache_utils.py``), not copied:

- Each attention layer has a spec: full attention, or a sliding window of ``W`` tokens
  (``SlidingWindowSpec``). A layer's most blocks for one request (``max_memory_usage_bytes`` /
  page): full ``cdiv(max_model_len, block_size)``; sliding
  ``cdiv(min(W - 1 + max_num_batched_tokens, max_model_len), block_size) + 1`` (the window's
  last ``W - 1`` computed tokens plus one step's new tokens, plus one block because the window
  need not start on a block boundary).
- One spec for every layer (all full, or all sliding with one window, as Mistral): one group of
  all layers; ``num_blocks = available // page // layers``; KV tokens ``num_blocks x block_size``.
- Several specs (Gemma-2/3: sliding and full layers) with the hybrid allocator (the default): the
  layers of each spec are cut into groups of ``group_size`` layers, ``group_size`` = the fewest
  layers of any spec (the largest when no spec has 1.5x the fewest: a later source's rule that
  only matters for near-equal counts such as 12 + 13), the last group of a spec padded; every
  group has its own block table over one shared pool: ``num_blocks = available // page //
  group_size``; KV tokens ``num_blocks // groups x block_size`` (``_report_kv_cache_config``).
- ``--disable-hybrid-kv-cache-manager``: sliding layers are given full-attention specs when full
  layers exist (``unify_hybrid_kv_cache_specs``): the window saves compute, not memory.
- Maximum concurrency (``get_max_concurrency_for_kv_cache_config``): ``num_blocks /`` the blocks
  one request of ``max_model_len`` needs summed over the groups; the start-up check
  (``check_enough_kv_cache_memory``) sums each layer's most bytes.

Example (Gemma-3-style 5 sliding : 1 full, window 1024, 32768-token requests, blocks of 16, budget 8192):
    >>> g = kv_groups((1024,) * 5 + (None,))
    >>> g.group_size, len(g.groups)
    (1, 6)
    >>> g.blocks_per_request(32768, 8192, 16)   # 5 x (cdiv(1023 + 8192, 16) + 1) + 32768 / 16
    4933
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from boomfx.core.errors import OptionError

HYBRID_GROUP_SIZE_RATIO = 1.5   # kv_cache_utils: use the largest count when it is below 1.5x the smallest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_max_blocks(window: Optional[int], max_model_len: int, max_num_batched_tokens: int, block_size: int) -> int:
    """The most blocks one layer of this spec holds for one request (see the module docstring)."""
    if window is None:
        return cdiv(max_model_len, block_size)
    return cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1


@dataclass(frozen=True)
class KVGroup:
    window: Optional[int]          # None: full attention
    layers: tuple[int, ...]        # indices of the attention layers (fewer than group_size: padded)


@dataclass(frozen=True)
class KVGroups:
    """The engine's grouping of a model's attention layers by KV-cache spec."""

    windows: tuple[Optional[int], ...]   # per layer, after the hybrid-manager rule
    group_size: int                      # layers per group = memory pools sharing the block pool
    groups: tuple[KVGroup, ...]

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, w in enumerate(self.windows) if w is not None)

    def num_blocks(self, available_bytes: int, page_bytes: int) -> int:
        return max(0, int(available_bytes) // page_bytes // self.group_size)

    def kv_tokens(self, num_blocks: int, block_size: int) -> int:
        return num_blocks // len(self.groups) * block_size

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int, block_size: int) -> int:
        return sum(layer_max_blocks(g.window, max_model_len, max_num_batched_tokens, block_size) for g in self.groups)

    def needed_bytes(self, page_bytes: int, max_model_len: int, max_num_batched_tokens: int, block_size: int) -> int:
        """The start-up check's bytes for one request of ``max_model_len``: each layer's most."""
        return page_bytes * sum(layer_max_blocks(w, max_model_len, max_num_batched_tokens, block_size)
                                for w in self.windows)


def kv_groups(windows: Sequence[Optional[int]], hybrid_manager: bool = True) -> KVGroups:
    """Group layers whose windows are ``windows`` (``None``: full attention) as the engine does."""
    wins = tuple(windows)
    if not wins:
        raise OptionError("the model has no attention layers to cache")
    kinds = list(dict.fromkeys(wins))
    if not hybrid_manager and len(kinds) > 1:
        if None not in kinds:
            raise OptionError("--disable-hybrid-kv-cache-manager: layers with different sliding windows and no full "
                              "attention layer cannot share one KV-cache spec (the engine refuses this too)")
        wins = (None,) * len(wins)
        kinds = [None]
    if len(kinds) == 1:
        return KVGroups(wins, len(wins), (KVGroup(kinds[0], tuple(range(len(wins)))),))
    by_kind = {k: tuple(i for i, w in enumerate(wins) if w == k) for k in kinds}
    fewest, most = min(map(len, by_kind.values())), max(map(len, by_kind.values()))
    size = most if most < fewest * HYBRID_GROUP_SIZE_RATIO else fewest
    groups = tuple(KVGroup(k, layers[i:i + size]) for k, layers in by_kind.items() for i in range(0, len(layers), size))
    return KVGroups(wins, size, groups)
