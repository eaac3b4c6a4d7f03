"""Device memory that the caching allocator's statistics do not show, as named, overridable items.

Why: ``torch.cuda.memory_reserved()`` leaves out the CUDA context and library buffers, yet they count
against the device's capacity. Each item says whether it lives *outside* the allocator (it shrinks the
capacity the allocator sees) or goes *through* it (it must be replayed as an allocation).

Defaults and their sources:
    * ``cuda_context``: 512 MiB, outside. Not a PyTorch constant: the CUDA driver's context, module images
      and per-SM local memory, seen as a few hundred MiB with lazy module loading on recent GPUs and
      drivers. Measure (``nvidia-smi`` minus ``memory_reserved``) and override it.
    * ``cublas_workspace``: through the allocator. ``aten/src/ATen/cuda/CublasHandlePool.cpp``:
      ``getNewWorkspace`` calls ``CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())`` once per
      (handle, stream); ``parseChosenWorkspaceSize`` defaults to 32 MiB (``4096 * 8 * 1024``) on compute
      capability major 9, 10, 11 and 12 (Hopper, Blackwell) and to ``:4096:2:16:8`` = 2 x 4 MiB + 8 x 16 KiB
      = 8,519,680 B otherwise (``CUBLAS_WORKSPACE_CONFIG`` overrides it). The cuBLASLt workspace is unified
      with it by default (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``), so it adds nothing.
    * ``nccl``: 0 by default, outside (NCCL allocates its buffers with cudaMalloc directly).

Example:
    >>> m = OutsideMemory.parse("cuda_context=600MiB,nccl=1GiB")
    >>> m.total_bytes // MiB
    1624
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

MiB = 1024 * 1024
GiB = 1024 * MiB
KiB = 1024

CUBLAS_WORKSPACE_HOPPER_PLUS_BYTES = 4096 * 8 * KiB           # parseChosenWorkspaceSize, major 9/10/11/12
CUBLAS_WORKSPACE_DEFAULT_BYTES = 4096 * KiB * 2 + 16 * KiB * 8  # ":4096:2:16:8"
DEFAULT_CUDA_CONTEXT_BYTES = 512 * MiB                         # measured-typical, not a source constant

_UNITS = {"": 1, "b": 1, "kib": KiB, "kb": 1000, "mib": MiB, "mb": 1000 ** 2, "gib": GiB, "gb": 1000 ** 3}


@dataclass(frozen=True)
class MemoryItem:
    """One named chunk of device memory and whether the caching allocator hands it out."""

    name: str
    nbytes: int
    through_allocator: bool
    source: str


def cublas_workspace_bytes(compute_capability_major: Optional[int]) -> int:
    """parseChosenWorkspaceSize's default for a device (None: unknown, take the smaller default)."""
    if compute_capability_major in (9, 10, 11, 12):
        return CUBLAS_WORKSPACE_HOPPER_PLUS_BYTES
    return CUBLAS_WORKSPACE_DEFAULT_BYTES


def parse_bytes(text: str) -> int:
    """'600MiB', '1.5GiB', '4096' -> bytes. Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use a number with B, KiB, MiB, GiB, KB, MB or GB.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class OutsideMemory:
    """Memory next to the allocator; ``total_bytes`` is what shrinks the capacity the allocator sees."""

    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES
    cublas_workspace_bytes: int = CUBLAS_WORKSPACE_HOPPER_PLUS_BYTES
    cublas_workspaces: int = 1  # one per (cuBLAS handle, stream) pair that runs a GEMM
    nccl_bytes: int = 0

    @classmethod
    def for_device(cls, compute_capability_major: Optional[int], **overrides: int) -> "OutsideMemory":
        """Defaults for a device of the given compute capability."""
        return cls(cublas_workspace_bytes=cublas_workspace_bytes(compute_capability_major), **overrides)

    @classmethod
    def parse(cls, text: str, base: Optional["OutsideMemory"] = None) -> "OutsideMemory":
        """'cuda_context=600MiB,cublas_workspace=32MiB,cublas_workspaces=2,nccl=0' over ``base``."""
        fields = {"cuda_context": "cuda_context_bytes", "cublas_workspace": "cublas_workspace_bytes",
                  "nccl": "nccl_bytes", "cublas_workspaces": "cublas_workspaces"}
        values: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            key = key.strip()
            if not sep or key not in fields:
                raise ValueError(f"unknown outside-memory item {part!r}; expected one of {sorted(fields)} as key=size.")
            if key == "cublas_workspaces":
                if not val.strip().isdigit():
                    raise ValueError(f"cublas_workspaces needs a whole number, not {val!r}.")
                values[fields[key]] = int(val)
            else:
                values[fields[key]] = parse_bytes(val)
        return replace(base or cls(), **values)

    def items(self) -> tuple[MemoryItem, ...]:
        """Every item, with where it lives and where its default comes from."""
        return (
            MemoryItem("cuda_context", self.cuda_context_bytes, False,
                       "CUDA driver context; measured-typical default, override it"),
            MemoryItem("cublas_workspace", self.cublas_workspace_bytes * self.cublas_workspaces, True,
                       "CublasHandlePool.cpp getNewWorkspace -> CUDACachingAllocator"),
            MemoryItem("nccl", self.nccl_bytes, False, "NCCL buffers, cudaMalloc'd outside the allocator"),
        )

    @property
    def total_bytes(self) -> int:
        """Bytes outside the allocator (reduce the capacity handed to the allocator model)."""
        return sum(i.nbytes for i in self.items() if not i.through_allocator)

    @property
    def allocator_bytes(self) -> int:
        """Bytes of long-lived allocations that go through the allocator (replay them as allocations)."""
        return sum(i.nbytes for i in self.items() if i.through_allocator)

    def allocator_sizes(self) -> tuple[tuple[str, int], ...]:
        """(label, nbytes) of each through-allocator allocation, e.g. one cuBLAS workspace per stream."""
        return tuple(("cublas_workspace", self.cublas_workspace_bytes) for _ in range(self.cublas_workspaces)
                     if self.cublas_workspace_bytes > 0)
