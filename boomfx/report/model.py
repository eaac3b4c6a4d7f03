"""The Report: everything an analysis found, as plain dataclasses with a versioned JSON form.

Renderers (text, JSON, Chrome trace, memory snapshot) read the Report and nothing else. Units are
in field names. ``SCHEMA_VERSION`` changes whenever a field changes meaning or is removed; adding
an optional field bumps the minor number. ``docs/json-schema.md`` documents every field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from boomfx.kernels_db.price import PriceSource

SCHEMA_VERSION = "1.3"

# Where a time figure came from, best first (the one vocabulary: kernels_db/price.py)
SOURCES = tuple(source.value for source in PriceSource)


@dataclass
class SymbolReport:
    name: str
    role: Optional[str]
    min_value: int
    max_value: Optional[int]
    value: Optional[int]
    names: list[str] = field(default_factory=list)   # other names --dim accepts (Dim names, "input.dim")


@dataclass
class KernelReport:
    """One kernel of the step (views and bookkeeping nodes launch none and are not listed)."""

    node: str
    op: str
    module: str
    phase: str
    flops: float
    bytes_moved: int
    time_ns: float
    host_ns: float
    start_ns: float
    source: str
    modelled: bool
    workspace_bytes: int = 0
    block: Optional[str] = None


@dataclass
class GroupTime:
    """Time of a group of kernels (a module, op, phase, block, or source)."""

    name: str
    time_ns: float
    kernels: int
    share: float


@dataclass
class BlockReport:
    name: str                   # class label, e.g. "h.*" (GPT2Block)
    instances: int
    instance_names: list[str]
    time_ns_per_instance: float
    activation_bytes_per_instance: int


@dataclass
class AllocatorReport:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    fragmentation_bytes: int          # reserved - allocated at the reserved peak
    largest_free_block_bytes: int     # at the reserved peak
    segments: int
    num_alloc_retries: int
    num_ooms: int
    config: str


@dataclass
class MemoryReport:
    peak_live_bytes: int                      # tensor storages only, no allocator effects
    peak_step_node: str
    by_category_bytes: dict[str, int]         # at the peak of live bytes
    resident_bytes: int                       # before the step starts (params, optimizer state, inputs)
    workspace_bytes: int                      # kernel scratch at the peak (from measurements)
    allocator: Optional[AllocatorReport]      # None on CPU devices (no caching allocator)
    outside_allocator_bytes: dict[str, int]   # CUDA context, cuBLAS workspace, ...
    device_capacity_bytes: int
    total_device_bytes: int                   # peak reserved (or live on CPU) + outside items
    fits: bool
    margin_bytes: int                         # capacity - total (negative: does not fit)
    oom_node: Optional[str] = None
    oom_module: Optional[str] = None


@dataclass
class TimeReport:
    total_ns: float
    device_busy_ns: float
    host_busy_ns: float
    host_bound_fraction: float
    kernels: int
    flops: float
    bytes_moved: int
    graph_entry_ns: float = 0.0               # --compile: host time entering the compiled graphs
    cold_start_ns: float = 0.0                # CPU targets: host code run from caches a kernel evicted
    eager_dispatch_ns: float = 0.0            # eager CPU targets: op switches, aliasing ops, autograd engine
    host_costs_source: str = ""               # of the two above: "measured", "partly measured" or "default"
    page_faults_ns: float = 0.0               # CPU targets: pages glibc maps afresh for the step (in kernel times)
    heap_refault_estimate_ns: float = 0.0     # CPU targets: heap pages refaulted after glibc's trims, estimated
                                              # (not in total_ns: the runtime's small allocations often prevent them)


@dataclass
class Report:
    """A prediction for one program, device and binding of its symbols."""

    source: str
    device: str
    device_description: str
    mode: str                                 # "inference" or "train"
    options: dict[str, Any]
    symbols: list[SymbolReport]
    time: TimeReport
    memory: MemoryReport
    by_module: list[GroupTime]
    by_op: list[GroupTime]
    by_phase: list[GroupTime]
    by_source: list[GroupTime]                # provenance: share of predicted time per source
    blocks: list[BlockReport]
    unmodelled_ops: dict[str, int]            # op -> count, priced by bytes moved
    kernels: list[KernelReport] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    analysis_seconds: float = 0.0
    schema_version: str = SCHEMA_VERSION
    # --parallel: every rank class of the step (boomfx/distributed/analysis.py ParallelReport); this
    # Report is then one rank's (parallel["shown_rank"])
    parallel: Optional[dict[str, Any]] = None

    def to_dict(self, include_kernels: bool = True) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not include_kernels:
            data["kernels"] = []
        return data

    def to_json(self, include_kernels: bool = True, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(include_kernels), indent=indent, sort_keys=False)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Report":
        major = str(data.get("schema_version", "0")).split(".")[0]
        if major != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(f"report schema {data.get('schema_version')} is not readable by {SCHEMA_VERSION}")
        d = dict(data)
        d["symbols"] = [SymbolReport(**s) for s in d["symbols"]]
        d["time"] = TimeReport(**d["time"])
        mem = dict(d["memory"])
        mem["allocator"] = AllocatorReport(**mem["allocator"]) if mem.get("allocator") else None
        d["memory"] = MemoryReport(**mem)
        for key in ("by_module", "by_op", "by_phase", "by_source"):
            d[key] = [GroupTime(**g) for g in d[key]]
        d["blocks"] = [BlockReport(**b) for b in d["blocks"]]
        d["kernels"] = [KernelReport(**k) for k in d.get("kernels", [])]
        return Report(**d)

    @staticmethod
    def from_json(text: str) -> "Report":
        return Report.from_dict(json.loads(text))
