"""glibc's malloc (ptmalloc2, main arena) as an eager CPU step meets it: which allocations touch pages the
kernel must hand over afresh (minor page faults), step after step.

Why: PyTorch's CPU allocator is ``posix_memalign(64)``/``free``. glibc serves a request from its heap's
free chunks or the heap's top, grows the heap with ``brk`` when neither fits, and maps a request of at
least its *mmap threshold* on its own; freeing a mapped chunk unmaps it and raises the threshold to its
size (at most 32 MiB), and freeing into a top chunk larger than the *trim threshold* (twice the mmap
threshold once it moved) gives the top back to the kernel. Fresh pages fault on their first write. An
eager step frees and allocates its activations anew each step, so outputs glibc must map (no free heap
memory holds them: always at 32 MiB and more) fault every step, and so do heap pages a trim returned
(``benchmarks/cpu_page_faults.py``: a ResNet-style inference step spends +76..+159% in them).

Rules (glibc 2.36 ``malloc/malloc.c``):

* chunk = request + 8 bytes of header, rounded up to 16, at least 32; ``posix_memalign(a)`` asks for the
  chunk + a + 32 and gives back its misaligned lead and its spare tail as chunks of their own;
* a small chunk comes from the thread cache (7 per size) or a fast bin (<= 128 bytes) first; any other
  request is served by the smallest free heap chunk that holds it (glibc's bins), split, else from the top
  chunk when it holds the chunk plus a minimum chunk (a request of 1 KiB or more, or a top too small,
  first coalesces the fast bins);
* otherwise a chunk of at least ``mmap_threshold`` is mapped (its pages rounded up, all fresh), a
  smaller one grows the heap by the chunk + ``TOP_PAD`` (128 KiB) less the top's free bytes, in pages;
* freeing a mapped chunk larger than the threshold (and at most ``MMAP_THRESHOLD_MAX``) sets the
  threshold to its size and the trim threshold to twice that; a freed small chunk goes to the thread cache
  or a fast bin (still in use for coalescing); any other merges with free neighbours and the top, and
  when the merged chunk is at least 64 KiB and the top at least the trim threshold, the top is cut back to
  ``TOP_PAD`` (whole pages returned);
* heap pages below the highest address written since the heap last shrank are resident (the heap's
  memory is written from its bottom up); a chunk reaching above it faults the pages it adds.

Checked: ``replay_in_glibc`` runs the same calls through this process's glibc; on the step sequences of
``tests/test_glibc_heap.py`` (convolution and MLP stacks, plain and aligned) the fault counts agree within
the few pages ctypes itself touches, and a C program replaying the >= 64 KiB calls PyTorch made in a
ResNet-style step (logged with an LD_PRELOAD shim) faulted exactly the simulated 23,360 pages.

Known limitations: the runtime's own small allocations (tensor metadata, autograd nodes, Python objects)
are not in a graph's events, and where they sit decides whether a trim happens: real steps refault
0-1.3x (median 0.6x) the heap pages this model says a trim returns (``cpu_page_faults.md``), chaotically (the same
script faulted 0 or 2,944 pages a step from one run to the next); one arena (worker threads' arenas are
not modelled); the process's history before the model runs is summarised as the threshold ``import
torch`` leaves (``THRESHOLD_AFTER_IMPORT``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Hashable, Iterable, NamedTuple, Optional, Sequence

PAGE_BYTES = 4096
MIN_CHUNK = 32
HEADER_BYTES = 8
CHUNK_ALIGN = 16
TOP_PAD = 128 << 10                    # M_TOP_PAD's default: each brk grows the heap by this much more
MMAP_THRESHOLD_MIN = 128 << 10         # DEFAULT_MMAP_THRESHOLD_MIN
MMAP_THRESHOLD_MAX = 32 << 20          # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 128 << 10             # DEFAULT_TRIM_THRESHOLD, until the first mapped chunk is freed
CONSOLIDATION_BYTES = 64 << 10         # FASTBIN_CONSOLIDATION_THRESHOLD: smaller frees never trim
LARGE_CHUNK = 1024                     # MIN_LARGE_SIZE: a request this large consolidates the fast bins first
MAX_FAST_CHUNK = 128                   # DEFAULT_MXFAST's chunk: freed chunks this small wait in fast bins
TCACHE_MAX_CHUNK = 1040                # the thread cache's largest chunk (a 1032-byte request)
TCACHE_COUNT = 7                       # chunks of each size the thread cache holds
# Measured (torch 2.13.0, glibc 2.36, development host): after ``import torch`` requests of 936 KiB
# came from the heap and 952 KiB were mapped; importing torch frees a mapped chunk of about that size.
THRESHOLD_AFTER_IMPORT = 944 << 10


def chunk_bytes(request: int) -> int:
    """The chunk glibc carves for a request of ``request`` bytes."""
    return max(MIN_CHUNK, -(-(request + HEADER_BYTES) // CHUNK_ALIGN) * CHUNK_ALIGN)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES)


@dataclass
class _Chunk:
    addr: int
    size: int
    mapped: bool


class GlibcHeap:
    """The main arena's heap, its mapped chunks and its thresholds; ``malloc``/``memalign`` return the
    pages the allocation faults when the caller writes it whole. ``tcache_slots``: freed chunks of each
    small size the thread's cache keeps out of coalescing (glibc's default, 7)."""

    def __init__(self, mmap_threshold: int = THRESHOLD_AFTER_IMPORT, tcache_slots: int = TCACHE_COUNT) -> None:
        self.mmap_threshold = mmap_threshold
        self.trim_threshold = TRIM_THRESHOLD if mmap_threshold <= MMAP_THRESHOLD_MIN else 2 * mmap_threshold
        self.tcache_slots = tcache_slots
        self.top_start = 0        # the top chunk spans [top_start, brk)
        self.brk = 0
        self.written_end = 0      # every heap byte below this is resident
        self._by_size: list[tuple[int, int]] = []      # free heap chunks as (size, addr), sorted
        self._size_at: dict[int, int] = {}             # free chunk addr -> size
        self._start_at_end: dict[int, int] = {}        # free chunk end -> addr
        self._fast: dict[int, list[int]] = {}          # size -> fast-bin chunks: in use until consolidated
        self._tcache: dict[int, list[int]] = {}        # size -> chunks the thread cache holds
        self._has_fast = False
        self.last_mapped = False                       # whether the last allocation got a mapping of its own
        self._live: dict[Hashable, _Chunk] = {}        # allocation id -> chunk
        self.faults = 0                                # pages faulted in all
        self.trims = 0

    # -- free heap chunks -----------------------------------------------------------------------
    def _add_free(self, addr: int, size: int) -> None:
        bisect.insort(self._by_size, (size, addr))
        self._size_at[addr] = size
        self._start_at_end[addr + size] = addr

    def _remove_free(self, addr: int) -> int:
        size = self._size_at.pop(addr)
        del self._start_at_end[addr + size]
        del self._by_size[bisect.bisect_left(self._by_size, (size, addr))]
        return size

    # -- the calls ------------------------------------------------------------------------------
    def malloc(self, alloc_id: Hashable, request: int) -> int:
        """Place allocation ``alloc_id`` of ``request`` bytes; the pages it faults when written."""
        size = chunk_bytes(request)
        cached = self._tcache.get(size) or (self._fast.get(size) if size <= MAX_FAST_CHUNK else None)
        if cached:                                           # the thread cache, then a fast bin: LIFO
            return self._place(alloc_id, cached.pop(), size)
        addr, size = self._int_malloc(size)
        return self._place(alloc_id, addr, size)

    def memalign(self, alloc_id: Hashable, request: int, alignment: int = 64) -> int:
        """``posix_memalign`` (PyTorch's CPU allocator, 64-byte alignment): a chunk of the request plus
        the alignment and a minimum chunk, its misaligned lead and its spare tail given back as chunks
        of their own (small ones to the thread cache, else the fast bins, which coalesce only at the next
        large request)."""
        nb = chunk_bytes(request)
        addr, size = self._int_malloc(chunk_bytes(nb + alignment + MIN_CHUNK))
        if addr < 0:
            return self._place(alloc_id, addr, size)
        mem = addr + 2 * HEADER_BYTES
        if mem % alignment:
            lead = (mem + alignment - 1) // alignment * alignment - 2 * HEADER_BYTES - addr
            if lead < MIN_CHUNK:
                lead += alignment
            self._release(addr, lead)
            addr, size = addr + lead, size - lead
        if size > nb + MIN_CHUNK:
            self._release(addr + nb, size - nb)
            size = nb
        return self._place(alloc_id, addr, size)

    def free(self, alloc_id: Hashable) -> None:
        chunk = self._live.pop(alloc_id)
        if chunk.mapped:
            if self.mmap_threshold < chunk.size <= MMAP_THRESHOLD_MAX:
                self.mmap_threshold = chunk.size
                self.trim_threshold = 2 * chunk.size
            return
        self._release(chunk.addr, chunk.size)

    # -- glibc's internals ----------------------------------------------------------------------
    def _int_malloc(self, size: int) -> tuple[int, int]:
        """(address, chunk size) of a chunk of at least ``size``; address -1: a mapping of its own."""
        if size >= LARGE_CHUNK and self._has_fast:
            self._consolidate()
        while True:
            i = bisect.bisect_left(self._by_size, (size, -1))
            if i < len(self._by_size):                       # best fit among the free chunks
                free_size, addr = self._by_size[i]
                self._remove_free(addr)
                if free_size - size >= MIN_CHUNK:
                    self._add_free(addr + size, free_size - size)
                    return addr, size
                return addr, free_size
            if self.brk - self.top_start >= size + MIN_CHUNK:  # the top chunk
                addr, self.top_start = self.top_start, self.top_start + size
                return addr, size
            if not self._has_fast:
                break
            self._consolidate()
        if size >= self.mmap_threshold:                      # a mapping of its own
            return -1, _pages(size + HEADER_BYTES) * PAGE_BYTES
        self.brk += _pages(size + TOP_PAD + MIN_CHUNK - (self.brk - self.top_start)) * PAGE_BYTES
        addr, self.top_start = self.top_start, self.top_start + size
        return addr, size

    def _place(self, alloc_id: Hashable, addr: int, size: int) -> int:
        self.last_mapped = addr < 0
        if addr < 0:
            self._live[alloc_id] = _Chunk(addr, size, True)
            self.faults += size // PAGE_BYTES
            return size // PAGE_BYTES
        self._live[alloc_id] = _Chunk(addr, size, False)
        end = addr + size
        if end <= self.written_end:
            return 0
        fresh = _pages(end) - _pages(self.written_end)
        self.written_end = end
        self.faults += fresh
        return fresh

    def _release(self, addr: int, size: int) -> None:
        """``_int_free`` of a heap chunk: the thread cache, a fast bin, or coalescing (and maybe a trim)."""
        if size <= TCACHE_MAX_CHUNK:
            cache = self._tcache.setdefault(size, [])
            if len(cache) < self.tcache_slots:
                cache.append(addr)
                return
        if size <= MAX_FAST_CHUNK:
            self._fast.setdefault(size, []).append(addr)
            self._has_fast = True
            return
        merged = self._coalesce(addr, size)
        if merged >= CONSOLIDATION_BYTES:
            if self._has_fast:
                self._consolidate()
            if self.brk - self.top_start >= self.trim_threshold:
                self._trim()

    def _coalesce(self, addr: int, size: int) -> int:
        """Merge a freed chunk with its free neighbours and the top; the merged chunk's size."""
        before = self._start_at_end.get(addr)
        if before is not None:                               # a free chunk below
            size += self._remove_free(before)
            addr = before
        if addr + size == self.top_start:                    # the top
            self.top_start = addr
            return self.brk - addr
        if addr + size in self._size_at:                     # a free chunk above
            size += self._remove_free(addr + size)
        self._add_free(addr, size)
        return size

    def _consolidate(self) -> None:
        """``malloc_consolidate``: every fast-bin chunk coalesced (no trim)."""
        fast, self._fast, self._has_fast = self._fast, {}, False
        for size, addrs in fast.items():
            for addr in addrs:
                self._coalesce(addr, size)

    def _trim(self) -> None:
        """``systrim``: give whole pages of the top above ``TOP_PAD`` back to the kernel."""
        area = self.brk - self.top_start - MIN_CHUNK - 1
        if area <= TOP_PAD:
            return
        extra = (area - TOP_PAD) // PAGE_BYTES * PAGE_BYTES
        if extra <= 0:
            return
        self.brk -= extra
        self.written_end = min(self.written_end, self.brk)
        self.trims += 1


class StepFaults(NamedTuple):
    """The pages one allocation faults in the steady step, and whether glibc mapped it afresh (else: heap
    pages the last trim had given back, or never had)."""

    pages: int
    mapped: bool


@dataclass(frozen=True)
class HeapEvent:
    """One allocator call of a step: ``alloc`` of ``nbytes`` for ``alloc_id``, or its ``free``."""

    kind: str
    alloc_id: Hashable
    nbytes: int = 0


def steady_step_faults(resident: Sequence[int], step: Sequence[HeapEvent], warmup_steps: int = 3,
                       heap: Optional[GlibcHeap] = None, alignment: Optional[int] = 64) -> list[StepFaults]:
    """What each event of ``step`` faults in the step after ``warmup_steps`` (as a timed loop after its
    warm-up): ``resident`` allocations (weights, inputs, state) are made first and never freed; storages
    a step allocates and does not free die at its end (the caller drops its outputs). ``alignment``:
    ``posix_memalign``'s, as PyTorch's CPU allocator asks (None: plain ``malloc``)."""
    heap = heap or GlibcHeap()
    place = heap.malloc if alignment is None else (lambda i, n: heap.memalign(i, n, alignment))
    for i, nbytes in enumerate(resident):
        place(("resident", i), nbytes)
    none = StepFaults(0, False)
    faults: list[StepFaults] = []
    for n in range(warmup_steps + 1):
        last = n == warmup_steps
        faults = [none] * len(step) if last else faults
        live: dict[Hashable, None] = {}
        for i, event in enumerate(step):
            if event.kind == "alloc":
                pages = place(event.alloc_id, event.nbytes)
                live[event.alloc_id] = None
                if last and pages:
                    faults[i] = StepFaults(pages, heap.last_mapped)
            else:
                heap.free(event.alloc_id)
                live.pop(event.alloc_id, None)
        for alloc_id in live:
            heap.free(alloc_id)
    return faults


def replay_in_glibc(resident: Iterable[int], step: Sequence[HeapEvent], warmup_steps: int = 3,
                    alignment: Optional[int] = 64) -> int:
    """The minor faults the last of ``warmup_steps + 1`` steps of ``step`` takes in this process's real
    glibc (``posix_memalign``, or ``malloc`` with ``alignment=None``; a write to every byte; ``free``): the
    truth ``steady_step_faults`` is tested against. Run it in a fresh process: the thresholds only rise."""
    import ctypes
    import resource

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    free, memset = libc.free, libc.memset
    out = ctypes.c_void_p()

    def malloc(nbytes: int) -> int:
        if alignment is None:
            return libc.malloc(nbytes)
        libc.posix_memalign(ctypes.byref(out), alignment, nbytes)
        return out.value

    # everything Python needs in the loop is made first: a dict or list growing there is a malloc of its own
    ids = {alloc_id: i for i, alloc_id in enumerate(dict.fromkeys(e.alloc_id for e in step))}
    calls = [(event.kind == "alloc", ids[event.alloc_id], event.nbytes) for event in step]
    pointers = (ctypes.c_void_p * max(len(ids), 1))()
    live = [False] * len(ids)
    for nbytes in resident:
        memset(malloc(nbytes), 1, nbytes)
    faults = 0
    for _ in range(warmup_steps + 1):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for is_alloc, slot, nbytes in calls:
            if is_alloc:
                pointers[slot] = malloc(nbytes)
                memset(pointers[slot], 1, nbytes)
            else:
                free(pointers[slot])
            live[slot] = is_alloc
        for slot, alive in enumerate(live):
            if alive:
                free(pointers[slot])
                live[slot] = False
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults
