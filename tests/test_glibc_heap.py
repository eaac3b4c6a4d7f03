"""glibc's heap model (boomfx/memory/glibc_heap.py): its rules by hand, and its fault counts against this
process's real glibc replaying the same calls (a fresh process per replay: glibc's thresholds only rise)."""
from __future__ import annotations

import ctypes.util
import json
import platform
import subprocess
import sys

import pytest

from boomfx.memory.glibc_heap import (MIN_CHUNK, MMAP_THRESHOLD_MAX, MMAP_THRESHOLD_MIN, PAGE_BYTES, TOP_PAD,
                                      GlibcHeap, HeapEvent, chunk_bytes, steady_step_faults)

MiB = 1 << 20
_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _pages(n: int) -> int:
    return -(-n // PAGE_BYTES)


def test_chunk_sizes_follow_request2size():
    assert [chunk_bytes(n) for n in (0, 1, 24, 25, 40, 1000)] == [32, 32, 32, 48, 48, 1008]


def test_first_small_request_grows_the_heap_by_the_chunk_and_the_pad():
    heap = GlibcHeap(MMAP_THRESHOLD_MIN)
    faults = heap.malloc("a", 100_000)
    size = chunk_bytes(100_000)
    assert heap.brk == _pages(size + TOP_PAD + MIN_CHUNK) * PAGE_BYTES
    assert faults == _pages(size) and not heap.last_mapped


def test_a_freed_mapping_raises_the_mmap_and_trim_thresholds():
    heap = GlibcHeap(MMAP_THRESHOLD_MIN)
    assert heap.malloc("a", 4 * MiB) == _pages(chunk_bytes(4 * MiB) + 8) and heap.last_mapped
    heap.free("a")
    mapping = _pages(chunk_bytes(4 * MiB) + 8) * PAGE_BYTES
    assert (heap.mmap_threshold, heap.trim_threshold) == (mapping, 2 * mapping)
    # the same request is now under the threshold: it comes from the heap
    heap.malloc("b", 4 * MiB)
    assert not heap.last_mapped and heap.brk > 4 * MiB


def test_no_threshold_beyond_32_mib():
    heap = GlibcHeap(MMAP_THRESHOLD_MIN)
    heap.malloc("a", 40 * MiB)
    heap.free("a")
    assert heap.mmap_threshold == MMAP_THRESHOLD_MIN
    heap.malloc("b", 40 * MiB)
    assert heap.last_mapped


def test_trim_returns_the_top_and_the_next_step_faults_it_again():
    """Two 6 MiB tensors freed into the top exceed twice the 6 MiB threshold: the heap shrinks to its pad,
    and allocating them again faults every page."""
    heap = GlibcHeap(6 * MiB + PAGE_BYTES)
    first = heap.malloc("a", 6 * MiB - 64) + heap.malloc("b", 6 * MiB - 64)
    heap.free("b")
    assert heap.trims == 0                     # one tensor's worth of free top: under the trim threshold
    heap.free("a")
    assert heap.trims == 1 and heap.top_start == 0 and heap.brk <= TOP_PAD + PAGE_BYTES
    kept = heap.brk // PAGE_BYTES                # the pad the trim keeps stays resident
    again = heap.malloc("a", 6 * MiB - 64) + heap.malloc("b", 6 * MiB - 64)
    assert first == 2 * _pages(chunk_bytes(6 * MiB - 64)) and again == first - kept


def test_best_fit_and_coalescing():
    heap = GlibcHeap(64 * MiB)                  # everything on the heap
    small = 2048                                # above the thread cache's sizes: freed chunks coalesce
    for name, size in (("a", 3 * MiB), ("x", small), ("b", 1 * MiB), ("y", small), ("c", 2 * MiB), ("z", small)):
        heap.malloc(name, size)
    for name in ("a", "b", "c"):
        heap.free(name)
    heap.malloc("d", 1 * MiB + 512 * 1024)     # not b (1 MiB: too small); c (2 MiB) is the best fit, not a (3 MiB)
    assert heap._live["d"].addr == chunk_bytes(3 * MiB) + chunk_bytes(small) + chunk_bytes(1 * MiB) + chunk_bytes(small)
    heap.free("x")                              # a (free) + x + b (free) become one chunk
    merged = [size for size, _ in heap._by_size]
    assert chunk_bytes(3 * MiB) + chunk_bytes(small) + chunk_bytes(1 * MiB) in merged


def test_memalign_returns_64_byte_aligned_memory_and_gives_back_its_lead_and_tail():
    heap = GlibcHeap(64 * MiB)
    heap.malloc("pad", 24)                      # the next chunk starts at 32: its memory (48) is misaligned
    heap.memalign("m", 10_000, 64)
    chunk = heap._live["m"]
    nb = chunk_bytes(10_000)
    # asked for nb + 64 + 32 at 32; the lead to the next 64-aligned memory (80 bytes: 16 is under a minimum
    # chunk) goes to the thread cache; the tail left (32 bytes) is not more than a minimum chunk, so it stays
    assert (chunk.addr, (chunk.addr + 16) % 64, chunk.size) == (112, 0, nb + 32)
    assert heap._tcache == {80: [32]}
    heap.memalign("n", 100_000, 64)             # starts aligned: no lead; its 112-byte tail is given back
    assert (heap._live["n"].addr + 16) % 64 == 0 and heap._live["n"].size == chunk_bytes(100_000)
    assert heap._tcache == {80: [32], 112: [heap._live["n"].addr + chunk_bytes(100_000)]}


def test_steady_step_faults_reports_mapped_allocations():
    step = [HeapEvent("alloc", 1, 40 * MiB), HeapEvent("alloc", 2, 100_000), HeapEvent("free", 1)]
    # no thread cache: the aligned chunk's lead and tail wait in fast bins and coalesce with it when it
    # is freed (a thread cache would keep the first seven of each size out of the heap: a new chunk each step)
    faults = steady_step_faults([], step, heap=GlibcHeap(tcache_slots=0))
    assert faults[0].mapped and faults[0].pages == _pages(chunk_bytes(40 * MiB + 64 + MIN_CHUNK) + 8)
    assert faults[1].pages == 0 and faults[2].pages == 0


# -- against the real glibc ----------------------------------------------------------------------

class _Calls:
    """A step's allocator calls, written as the ops make them."""

    def __init__(self) -> None:
        self.events: list[HeapEvent] = []

    def alloc(self, nbytes: int) -> int:
        self.events.append(HeapEvent("alloc", len(self.events), nbytes))
        return len(self.events) - 1

    def free(self, alloc_id: int) -> None:
        self.events.append(HeapEvent("free", alloc_id))

    def op(self, nbytes: int, *last_uses: int) -> int:
        """An op's output, then the frees of the inputs it used last."""
        out = self.alloc(nbytes)
        for alloc_id in last_uses:
            self.free(alloc_id)
        return out


def _conv_stack(activation: int, blocks: int = 3, scratch: bool = True) -> list[HeapEvent]:
    """A ResNet-style block stack's calls: conv (output, then its scratch), batch norm, ReLU, add."""
    c = _Calls()

    def conv_norm() -> int:
        conv = c.alloc(activation)
        if scratch:
            c.free(c.alloc(activation))
        norm = c.alloc(activation)
        c.free(conv)
        return norm

    x = c.alloc(activation)
    for _ in range(blocks):
        act = c.op(activation, conv_norm())
        summed = c.op(activation, conv_norm(), act)
        x = c.op(activation, summed, x)
    return c.events


def _mlp_stack(tokens: int, width: int, blocks: int = 4) -> list[HeapEvent]:
    """Transformer MLP blocks' calls: layer norm, up projection, GELU, down projection, residual add."""
    c = _Calls()
    row, wide = tokens * width * 4, tokens * 4 * width * 4
    x = c.alloc(row)
    for _ in range(blocks):
        up = c.op(wide, c.alloc(row))           # layer norm's output, used last by the up projection
        down = c.op(row, c.op(wide, up))
        x = c.op(row, down, x)
    return c.events


CASES = {"conv 6.4 MiB": lambda: _conv_stack(8 * 64 * 56 * 56 * 4),
         "conv 1.6 MiB no scratch": lambda: _conv_stack(2 * 64 * 56 * 56 * 4, scratch=False),
         "conv 12.8 MiB": lambda: _conv_stack(8 * 32 * 112 * 112 * 4),
         "mlp 512 tokens": lambda: _mlp_stack(1024, 768),
         "mlp 4096 tokens (48 MiB mapped)": lambda: _mlp_stack(4096, 768),
         "mlp 128 tokens": lambda: _mlp_stack(128, 768)}

# the replaying process imports nothing but the model's module: an import that frees a mapping of more than
# 128 KiB would raise glibc's threshold before the replay starts
_REPLAY = """
import json, sys
from boomfx.memory.glibc_heap import HeapEvent, replay_in_glibc
events = [HeapEvent(kind, i, n) for kind, i, n in json.loads(sys.argv[1])]
print(replay_in_glibc([1 << 20], events, alignment=json.loads(sys.argv[2])))
"""

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                                or ctypes.util.find_library("c") is None, reason="needs Linux's glibc")


@glibc_only
@pytest.mark.parametrize("alignment", [None, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_fault_counts_match_the_real_glibc(name, alignment):
    """A fresh process (no torch: glibc's first threshold, 128 KiB) replays the calls with ctypes and
    counts its minor faults; ctypes itself touches a few pages."""
    events = CASES[name]()
    proc = subprocess.run([sys.executable, "-c", _REPLAY, json.dumps([[e.kind, e.alloc_id, e.nbytes] for e in events]),
                           json.dumps(alignment)], capture_output=True, text=True, timeout=120, cwd=_ROOT)
    assert proc.returncode == 0, proc.stderr
    real = int(proc.stdout.strip().splitlines()[-1])
    simulated = sum(f.pages for f in steady_step_faults([1 << 20], events, heap=GlibcHeap(MMAP_THRESHOLD_MIN),
                                                        alignment=alignment))
    assert simulated > 500, "every case refaults: a trim or a mapping each step"
    assert abs(real - simulated) <= 16, (real, simulated)

