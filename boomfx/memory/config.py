"""Every constant and option of PyTorch's CUDA caching allocator, in one frozen value.

The allocator model (``boomfx.memory.allocator``) reads nothing else: no environment variable, no global.
Sources (read, not copied; symbol names given so a reader can find each line):

* ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch @ 001074d25084fdb87a799823e395a50f5ec044d3):
  ``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``, ``kMinLargeAlloc``, ``kRoundLarge``, ``kLargeBuffer``,
  ``round_size``, ``roundup_power2_next_division``, ``should_split``, ``get_allocation_size``.
* ``c10/core/AllocatorConfig.cpp`` (pytorch/pytorch @ 065861fba7598880aa3216822742a1172d0a197c), the parser
  that newer releases share between CUDA and other devices: ``AllocatorConfig::parseArgs``, ``lexArgs``,
  ``parseMaxSplitSize``, ``parseMaxNonSplitRoundingSize``, ``parseGarbageCollectionThreshold``,
  ``parseRoundUpPower2Divisions``, ``kRoundUpPowerOfTwoIntervals``.

Example:
    >>> cfg = AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True")
    >>> cfg.max_split_size_bytes // MiB, cfg.expandable_segments
    (128, True)

Known limitations:
    * ``backend:cudaMallocAsync`` is rejected: it replaces the caching allocator with the driver's pool.
    * Options that only affect pinned host memory or locking are accepted and kept in ``other_options``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

MiB = 1024 * 1024
_SIZE_MAX = 2 ** 64 - 1  # std::numeric_limits<size_t>::max(): the "unlimited" max_split_size


def _pow2_floor_log2(n: int) -> int:
    return n.bit_length() - 1


@dataclass(frozen=True)
class AllocatorConfig:
    """Constants mirrored from CUDACachingAllocator plus the PYTORCH_CUDA_ALLOC_CONF options."""

    # --- compile-time constants (CUDACachingAllocator.cpp) ---
    min_block_bytes: int = 512             # kMinBlockSize: all sizes are rounded to at least 512 B
    small_size_bytes: int = 1 * MiB        # kSmallSize: largest "small" request (small pool)
    small_buffer_bytes: int = 2 * MiB      # kSmallBuffer: small-pool segment size
    large_buffer_bytes: int = 20 * MiB     # kLargeBuffer: segment for 1 MiB < request < kMinLargeAlloc
    min_large_alloc_bytes: int = 10 * MiB  # kMinLargeAlloc: requests at or above get their own segment
    round_large_bytes: int = 2 * MiB       # kRoundLarge: such segments are rounded up to 2 MiB
    # should_split(): small pool (or expandable segments) splits when remainder >= kMinBlockSize;
    # large pool splits when request < max_split_size and remainder > kSmallSize (strictly).
    split_remainder_small_min_bytes: int = 512      # `remaining >= kMinBlockSize`
    split_remainder_large_above_bytes: int = 1 * MiB  # `remaining > kSmallSize`
    # ExpandableSegment: pages of 2 MiB for the small pool and kLargeBuffer for the large pool;
    # address space reserved per segment is totalGlobalMem + totalGlobalMem / 8.
    expandable_small_page_bytes: int = 2 * MiB
    expandable_large_page_bytes: int = 20 * MiB
    # AllocatorConfig.cpp: kRoundUpPowerOfTwoStart = 1 MiB, 16 intervals up to 64 GiB.
    roundup_intervals: int = 16
    roundup_start_bytes: int = 1 * MiB

    # --- runtime options (PYTORCH_CUDA_ALLOC_CONF; defaults from AllocatorConfig's constructor) ---
    max_split_size_bytes: int = _SIZE_MAX           # max_split_size_mb (default: unlimited)
    max_non_split_rounding_bytes: int = 20 * MiB    # max_non_split_rounding_mb (default kLargeBuffer)
    roundup_power2_divisions: tuple[int, ...] = (0,) * 16  # per power-of-two interval from 1 MiB
    garbage_collection_threshold: float = 0.0       # garbage_collection_threshold (0 = off)
    expandable_segments: bool = False               # expandable_segments
    # torch.cuda.set_per_process_memory_fraction (DeviceCachingAllocator::setMemoryFraction); the
    # garbage collector only runs when a fraction is set (`set_fraction` in malloc()).
    memory_fraction: Optional[float] = None
    other_options: tuple[tuple[str, str], ...] = field(default=())
    conf_string: str = ""

    # ----- derived rules -----
    @property
    def max_split_is_unlimited(self) -> bool:
        return self.max_split_size_bytes == _SIZE_MAX

    def divisions_for(self, size_bytes: int) -> int:
        """AllocatorConfig::roundup_power2_divisions(size): interval index = log2(size) - 20, clamped."""
        index = _pow2_floor_log2(size_bytes) - _pow2_floor_log2(self.roundup_start_bytes)
        index = min(max(index, 0), self.roundup_intervals - 1)
        return self.roundup_power2_divisions[index]

    def round_size(self, size_bytes: int) -> int:
        """DeviceCachingAllocator::round_size: 512 B multiples, or the next power-of-two division."""
        if size_bytes < self.min_block_bytes:
            return self.min_block_bytes
        divisions = self.divisions_for(size_bytes)
        if divisions > 1 and size_bytes > self.min_block_bytes * divisions:
            return _roundup_power2_next_division(size_bytes, divisions)
        blocks = (size_bytes + self.min_block_bytes - 1) // self.min_block_bytes
        return blocks * self.min_block_bytes

    def allocation_size(self, size_bytes: int) -> int:
        """get_allocation_size: the cudaMalloc size for a rounded request that found no cached block."""
        if size_bytes <= self.small_size_bytes:
            return self.small_buffer_bytes
        if size_bytes < self.min_large_alloc_bytes:
            return self.large_buffer_bytes
        pages = (size_bytes + self.round_large_bytes - 1) // self.round_large_bytes
        return pages * self.round_large_bytes

    def is_small(self, size_bytes: int) -> bool:
        """get_pool: rounded sizes <= kSmallSize go to the small pool."""
        return size_bytes <= self.small_size_bytes

    # ----- parsing -----
    @classmethod
    def parse(cls, conf: str, **overrides: object) -> "AllocatorConfig":
        """Parse a PYTORCH_CUDA_ALLOC_CONF-style string (never read from the environment).

        Raises ValueError with one sentence on an unknown key or a bad value.
        """
        return replace(_Parser(conf).run(cls()), **overrides)  # type: ignore[arg-type]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: e.g. 1200 B with 4 divisions of [1024, 2048) -> 1280."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << _pow2_floor_log2(size)
    step = power2_floor >> _pow2_floor_log2(divisions)
    if step == 0:
        return power2_floor << 1
    floor = size & ~(step - 1)
    return size if floor == size else floor + step


_IGNORED_BOOL_KEYS = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                      "pinned_use_background_threads")


class _Parser:
    """Token-by-token parser following AllocatorConfig::lexArgs / parseArgs."""

    def __init__(self, conf: str) -> None:
        self.conf = conf
        self.tokens: list[str] = []
        buf = ""
        for ch in conf:
            if ch in ",:[]":
                if buf:
                    self.tokens.append(buf)
                    buf = ""
                self.tokens.append(ch)
            elif ch != " ":
                buf += ch
        if buf:
            self.tokens.append(buf)
        self.i = 0

    def fail(self, msg: str) -> ValueError:
        return ValueError(f"Bad allocator config {self.conf!r}: {msg}.")

    def take(self) -> str:
        if self.i >= len(self.tokens):
            raise self.fail("the string ends where a value was expected")
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, ch: str) -> None:
        tok = self.take()
        if tok != ch:
            raise self.fail(f"expected {ch!r} but found {tok!r}")

    def integer(self, key: str) -> int:
        tok = self.take()
        if not tok.isdigit():
            raise self.fail(f"{key} needs a non-negative integer, not {tok!r}")
        return int(tok)

    def boolean(self, key: str) -> bool:
        tok = self.take()
        if tok not in ("True", "False"):
            raise self.fail(f"{key} takes True or False, not {tok!r}")
        return tok == "True"

    def run(self, cfg: AllocatorConfig) -> AllocatorConfig:
        values: dict[str, object] = {"conf_string": self.conf}
        others: list[tuple[str, str]] = []
        min_mb = cfg.large_buffer_bytes // MiB  # parseMaxSplitSize: min_allowed_split_size_mb
        while self.i < len(self.tokens):
            key = self.take()
            if key in ",:[]":
                raise self.fail(f"expected an option name but found {key!r}")
            self.expect(":")
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                mb = self.integer(key)
                if mb < min_mb:
                    raise self.fail(f"{key} must be >= {min_mb}")
                name = "max_split_size_bytes" if key == "max_split_size_mb" else "max_non_split_rounding_bytes"
                values[name] = min(mb * MiB, _SIZE_MAX)
            elif key == "garbage_collection_threshold":
                tok = self.take()
                try:
                    thr = float(tok)
                except ValueError:
                    raise self.fail(f"garbage_collection_threshold needs a number, not {tok!r}") from None
                if not 0.0 < thr < 1.0:
                    raise self.fail("garbage_collection_threshold must lie in (0.0, 1.0)")
                values["garbage_collection_threshold"] = thr
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = self.divisions(cfg.roundup_intervals)
            elif key == "expandable_segments":
                values["expandable_segments"] = self.boolean(key)
            elif key == "backend":
                tok = self.take()
                if tok != "native":
                    raise self.fail(f"backend {tok!r} is not modelled, only 'native' is")
            elif key in _IGNORED_BOOL_KEYS:
                others.append((key, str(self.boolean(key))))
            elif key == "pinned_num_register_threads":
                others.append((key, str(self.integer(key))))
            else:
                raise self.fail(f"unknown option {key!r}")
            if self.i < len(self.tokens):
                self.expect(",")
        values["other_options"] = tuple(others)
        return replace(cfg, **values)  # type: ignore[arg-type]

    def divisions(self, n: int) -> tuple[int, ...]:
        """parseRoundUpPower2Divisions: a single power of two, or a list [MB:div, ..., >:div]."""
        if self.i < len(self.tokens) and self.tokens[self.i] != "[":
            div = self.integer("roundup_power2_divisions")
            if div == 0 or div & (div - 1):
                raise self.fail("roundup_power2_divisions must be a power of 2")
            return (div,) * n
        self.expect("[")
        out = [0] * n
        first, last_index = True, 0
        while True:
            interval = self.take()
            if interval == "]":
                break
            self.expect(":")
            div = self.integer("roundup_power2_divisions")
            if div & (div - 1):
                raise self.fail("each roundup_power2_divisions value must be 0 or a power of 2")
            if interval == ">":
                out[last_index:] = [div] * (n - last_index)
            else:
                if not interval.isdigit() or int(interval) == 0 or int(interval) & (int(interval) - 1):
                    raise self.fail(f"roundup interval {interval!r} must be a power of 2 (in MB)")
                index = min(max(_pow2_floor_log2(int(interval)), 0), n - 1)
                if first:
                    out[:index] = [div] * index
                    first = False
                out[index] = div
                last_index = index
            nxt = self.take()
            if nxt == "]":
                break
            if nxt != ",":
                raise self.fail(f"expected ',' or ']' in the roundup list, found {nxt!r}")
        return tuple(out)
