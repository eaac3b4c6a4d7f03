"""Parsing PYTORCH_CUDA_ALLOC_CONF-style strings and the outside-the-allocator memory items."""
from __future__ import annotations

import pytest

from boomfx.memory.config import AllocatorConfig, MiB
from boomfx.memory.outside import (CUBLAS_WORKSPACE_DEFAULT_BYTES, OutsideMemory, cublas_workspace_bytes,
                                   parse_bytes)


def test_defaults_mirror_cuda_caching_allocator():
    c = AllocatorConfig()
    assert (c.min_block_bytes, c.small_size_bytes, c.small_buffer_bytes) == (512, 1 * MiB, 2 * MiB)
    assert (c.large_buffer_bytes, c.min_large_alloc_bytes, c.round_large_bytes) == (20 * MiB, 10 * MiB, 2 * MiB)
    assert c.max_split_is_unlimited and not c.expandable_segments
    assert c.garbage_collection_threshold == 0.0 and c.max_non_split_rounding_bytes == 20 * MiB


def test_parse_full_string():
    c = AllocatorConfig.parse("max_split_size_mb:128,roundup_power2_divisions:4,"
                              "garbage_collection_threshold:0.6,expandable_segments:True")
    assert c.max_split_size_bytes == 128 * MiB
    assert c.roundup_power2_divisions == (4,) * 16
    assert c.garbage_collection_threshold == 0.6 and c.expandable_segments


def test_parse_roundup_list_form():
    """parseRoundUpPower2Divisions: the first entry also fills lower intervals; '>' fills from the last."""
    c = AllocatorConfig.parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    # intervals are indexed by log2(MB): 64 MB -> 6
    assert c.divisions_for(32 * MiB) == 8 and c.divisions_for(64 * MiB) == 8
    assert c.divisions_for(128 * MiB) == 2 and c.divisions_for(256 * MiB) == 4
    assert c.divisions_for(1024 * MiB) == 1 and c.divisions_for(4096 * MiB) == 1


def test_round_size_power2_division_example():
    """roundup_power2_next_division comment: 1200 with 4 divisions of [1024, 2048) -> 1280 (helper)."""
    from boomfx.memory.config import _roundup_power2_next_division
    assert _roundup_power2_next_division(1200, 4) == 1280
    assert _roundup_power2_next_division(2048, 4) == 2048


def test_parse_keeps_overrides_and_spaces():
    c = AllocatorConfig.parse(" max_split_size_mb : 40 , release_lock_on_cudamalloc:True", memory_fraction=0.9)
    assert c.max_split_size_bytes == 40 * MiB and c.memory_fraction == 0.9
    assert c.other_options == (("release_lock_on_cudamalloc", "True"),)


@pytest.mark.parametrize("conf", [
    "unknown_key:1", "max_split_size_mb:10", "max_split_size_mb:abc", "garbage_collection_threshold:1.0",
    "garbage_collection_threshold:0", "expandable_segments:yes", "roundup_power2_divisions:3",
    "roundup_power2_divisions:[3:2]", "roundup_power2_divisions:[64:3]", "max_split_size_mb",
    "max_split_size_mb:40 expandable_segments:True", "backend:cudaMallocAsync", "max_split_size_mb:40,,",
])
def test_bad_strings_raise_value_error(conf):
    with pytest.raises(ValueError) as info:
        AllocatorConfig.parse(conf)
    assert str(info.value).count(".") >= 1 and "\n" not in str(info.value)


def test_outside_memory_parse_and_totals():
    m = OutsideMemory.parse("cuda_context=600MiB,cublas_workspace=32MiB,cublas_workspaces=2")
    assert m.total_bytes == 600 * MiB  # the cuBLAS workspace goes through the allocator
    assert m.allocator_bytes == 64 * MiB
    assert m.allocator_sizes() == (("cublas_workspace", 32 * MiB),) * 2


def test_cublas_workspace_default_per_arch():
    """CublasHandlePool.cpp parseChosenWorkspaceSize: 32 MiB on major 9/10/11/12, else :4096:2:16:8."""
    assert cublas_workspace_bytes(9) == 32 * MiB
    assert cublas_workspace_bytes(8) == CUBLAS_WORKSPACE_DEFAULT_BYTES == 2 * 4096 * 1024 + 8 * 16 * 1024
    assert OutsideMemory.for_device(8).cublas_workspace_bytes == CUBLAS_WORKSPACE_DEFAULT_BYTES


@pytest.mark.parametrize("text", ["cuda=1MiB", "cuda_context", "cuda_context=12 parsecs", "cublas_workspaces=x"])
def test_outside_memory_bad_strings(text):
    with pytest.raises(ValueError):
        OutsideMemory.parse(text)


def test_parse_bytes_units():
    assert parse_bytes("1.5GiB") == 1536 * MiB and parse_bytes("4096") == 4096 and parse_bytes("2 MB") == 2_000_000
