"""Public GPU kernel measurements (NeuSight, ASPLOS'25) as typed rows, and as boomfx ``OpCall`` values.

The data (``/work/shared/data/gpu-kernel-measurements/dataset/test/*.csv``) holds ~27k fp32 latencies
of ``linear``, ``bmm``, elementwise ops, layer norm and softmax on 8 NVIDIA GPUs, measured with torch
2.1.0 / CUDA 12.1 and TF32 disabled. No machine here can produce such numbers, so this module is the
one place that reads them; everything downstream (the store, the GPU model, its benchmark) sees only
``PublicKernelRow``.

Conventions fixed at ingest (style rule 9):

* ``latency_ns``: the CSV's ``Latency`` column is milliseconds (CUDA events); converted once by
  ``ms_to_ns``.
* GEMM sizes follow boomfx's convention: output ``[b, m, n]``, contraction depth ``k``. The CSV does
  *not*: NeuSight's collector builds ``bmm`` inputs ``(B, M, N) @ (B, N, K)`` and ``linear`` as
  ``nn.Linear(N, K)(x[B, M, N])``, so its ``N`` column is the contraction and its ``K`` column the
  output width. ``_gemm_sizes`` swaps them; ``csv_sizes`` keeps the raw columns for provenance.
* Devices are mapped to boomfx names (``DEVICE_NAMES``); "NVIDIA H100 80GB HBM3" is the SXM part.

Example::

    rows = load_public_rows()                       # every CSV under the default directory
    call = to_opcall(rows[0])                       # aten.linear / bmm / add / ... with TensorSpecs

Known limitations:

* Latencies are the mean of the 5 fastest of 25 CUDA-event timings around one *eager* op on an idle
  GPU, so they include the host's dispatch time (~5-15 us), and ``linear`` includes its bias epilogue.
  When a row launched several kernels (split-K GEMMs) the latency covers all of them; ``kernel_name``
  is only the main one.
* fp32 only, torch 2.1, PCIe A100s; elementwise/norm/softmax tensors are all >= 50 MB (NeuSight kept
  only "large" shapes), so small-tensor behaviour is not measured.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import sympy
import torch

from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten

# Default location of the public measurements: ``shared/data/gpu-kernel-measurements`` beside the checkout
# (the layout this project is developed in); every function also takes an explicit path, as the CLI does.
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu-kernel-measurements"
CSV_FILES: tuple[str, ...] = ("linear.csv", "bmm.csv", "elem.csv", "ln.csv", "softmax.csv")

SOURCE = "NeuSight (ASPLOS'25) public data"
SOURCE_URL = "https://github.com/sitar-lab/NeuSight (scripts/asplos/data, MIT licence)"

# The CSV's Device column -> boomfx device name (boomfx/core/devices.py).
DEVICE_NAMES: Mapping[str, str] = {
    "NVIDIA L4": "l4",
    "Tesla V100-PCIE-32GB": "v100-pcie-32gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA H100 80GB HBM3": "h100-sxm",       # HBM3 => the SXM5 part, not the PCIe card
    "Tesla P100-PCIE-16GB": "p100",
    "Tesla T4": "t4",
    "Tesla P4": "p4",
}

# The CSV's OPName -> boomfx public op name. "<op>u" rows are NeuSight's tensor-with-scalar forms.
OP_NAMES: Mapping[str, str] = {
    "linear": "linear", "bmm": "bmm",
    "add": "add", "mul": "mul", "div": "div", "pow": "pow",
    "addu": "add_scalar", "mulu": "mul_scalar", "divu": "div_scalar", "powu": "pow_scalar",
    "relu": "relu", "gelu": "gelu", "tanh": "tanh",
    "ln": "layer_norm", "softmax": "softmax",
}
MATMUL_OPS = frozenset({"linear", "bmm"})
BINARY_OPS = frozenset({"add", "mul", "div", "pow"})
SCALAR_OPS = frozenset({"add_scalar", "mul_scalar", "div_scalar", "pow_scalar"})
UNARY_OPS = frozenset({"relu", "gelu", "tanh"})
ELEMENTWISE_OPS = BINARY_OPS | SCALAR_OPS | UNARY_OPS
NORM_OPS = frozenset({"layer_norm", "softmax"})

# NeuSight's collector uses ``1 - random.random()`` as the scalar operand; its value is not recorded.
SCALAR_OPERAND = 0.5
LAYER_NORM_EPS = 1e-5


def ms_to_ns(value_ms: float) -> float:
    """The one unit conversion of this module: CUDA-event milliseconds to nanoseconds."""
    return float(value_ms) * 1e6


@dataclass(frozen=True)
class Provenance:
    """Where a measured row came from; kept with every row so imported records can cite it."""

    source: str = SOURCE
    url: str = SOURCE_URL
    file: str = ""
    torch_version: str = "2.1.0"
    cuda_version: str = "12.1"
    cudnn_version: str = ""
    tf32: bool = False


@dataclass(frozen=True)
class LaunchGeometry:
    """Launch configuration of the row's main kernel, as the profiler recorded it.

    ``warps_per_sm`` and ``blocks_per_sm`` are NeuSight's derived figures (grid blocks / SM count),
    not occupancy.
    """

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    warps_per_sm: float
    blocks_per_sm: float

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass(frozen=True)
class PublicKernelRow:
    """One measured op call.

    GEMMs (``linear``, ``bmm``): output ``[b, m, n]``, contraction ``k`` (boomfx convention, see module
    docstring); ``h`` is 0. Vector ops: a ``[b, h]`` fp32 tensor; ``m, n, k`` are 0.
    """

    op: str
    device: str                     # boomfx device name
    b: int
    m: int
    n: int
    k: int
    h: int
    dtype: torch.dtype
    latency_ns: float
    kernel_name: str
    kernels: tuple[str, ...]        # every kernel launched (lower-cased by the collector); may be empty
    geometry: LaunchGeometry
    provenance: Provenance
    source_device: str              # the CSV's Device string
    source_op: str                  # the CSV's OPName
    csv_sizes: Mapping[str, int] = field(default_factory=dict)

    @property
    def is_matmul(self) -> bool:
        return self.op in MATMUL_OPS

    @property
    def shape_key(self) -> tuple[int, ...]:
        """Sizes that identify the problem on one device, for grouping and held-out splits."""
        return (self.b, self.m, self.n, self.k) if self.is_matmul else (self.b, self.h)


# ---------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------

def _version(raw: str, prefix: str) -> str:
    """'p2.1.0' -> '2.1.0'; 'cu121' -> '12.1'."""
    value = raw.strip()
    if value.startswith(prefix):
        value = value[len(prefix):]
    if prefix == "cu" and value.isdigit() and len(value) >= 3:
        value = f"{value[:-1]}.{value[-1]}"
    return value


def _gemm_sizes(csv_row: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(b, m, n, k) in boomfx convention from NeuSight's columns (its N is the contraction)."""
    return int(csv_row["B"]), int(csv_row["M"]), int(csv_row["K"]), int(csv_row["N"])


def parse_csv_row(csv_row: Mapping[str, str], file: str = "") -> PublicKernelRow:
    """One CSV record as a typed row; raises KeyError on an unknown device or op (never guesses)."""
    source_op = csv_row["OPName"]
    op = OP_NAMES[source_op]
    device = DEVICE_NAMES[csv_row["Device"].strip()]
    if op in MATMUL_OPS:
        b, m, n, k = _gemm_sizes(csv_row)
        h = 0
        raw = {c: int(csv_row[c]) for c in ("B", "M", "N", "K")}
    else:
        b, h = int(csv_row["B"]), int(csv_row["H"])
        m = n = k = 0
        raw = {c: int(csv_row[c]) for c in ("B", "H")}
    kernels = tuple(s for s in csv_row.get("Kernels", "").split(";") if s)
    geometry = LaunchGeometry(
        grid=(int(csv_row["Grid x"]), int(csv_row["Grid y"]), int(csv_row["Grid z"])),
        block=(int(csv_row["Block x"]), int(csv_row["Block y"]), int(csv_row["Block z"])),
        warps_per_sm=float(csv_row["Warps per SM"]),
        blocks_per_sm=float(csv_row["Blocks per SM"]),
    )
    provenance = Provenance(
        file=file,
        torch_version=_version(csv_row["Torch Version"], "p"),
        cuda_version=_version(csv_row["CUDA Version"], "cu"),
        cudnn_version=csv_row.get("CUDNN Version", "").strip(),
    )
    return PublicKernelRow(
        op=op, device=device, b=b, m=m, n=n, k=k, h=h, dtype=torch.float32,
        latency_ns=ms_to_ns(float(csv_row["Latency"])), kernel_name=csv_row["Kernel Name"],
        kernels=kernels, geometry=geometry, provenance=provenance,
        source_device=csv_row["Device"], source_op=source_op, csv_sizes=raw,
    )


def iter_public_rows(path: Path | str = DEFAULT_DATA_DIR) -> Iterator[PublicKernelRow]:
    """Rows of one CSV file, or of every known CSV under a data directory (``dataset/test/``)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    else:
        base = path / "dataset" / "test" if (path / "dataset" / "test").is_dir() else path
        files = [base / name for name in CSV_FILES if (base / name).is_file()]
        if not files:
            raise FileNotFoundError(f"no public kernel CSVs ({', '.join(CSV_FILES)}) under {path}")
    for file in files:
        with open(file, newline="") as fh:
            for record in csv.DictReader(fh):
                yield parse_csv_row(record, file=file.name)


def load_public_rows(path: Path | str = DEFAULT_DATA_DIR) -> list[PublicKernelRow]:
    return list(iter_public_rows(path))


# ---------------------------------------------------------------------------------------------------
# Rows as boomfx OpCalls
# ---------------------------------------------------------------------------------------------------

def _spec(*shape: int, dtype: torch.dtype = torch.float32) -> TensorSpec:
    sizes = tuple(sympy.Integer(s) for s in shape)
    return TensorSpec(sizes, contiguous_strides(sizes), dtype)


def _transposed(rows: int, cols: int, dtype: torch.dtype) -> TensorSpec:
    """A ``[rows, cols]`` view of a contiguous ``[cols, rows]`` tensor (``weight.t()``)."""
    return TensorSpec((sympy.Integer(rows), sympy.Integer(cols)), (sympy.Integer(1), sympy.Integer(rows)), dtype)


def to_opcall(row: PublicKernelRow, linear_lowering: str = "linear") -> OpCall:
    """The boomfx ``OpCall`` that the measured eager call corresponds to, with concrete TensorSpecs.

    Args:
        row: a parsed public row.
        linear_lowering: ``"linear"`` (torch.export's default IR: ``aten.linear(x[1,m,k], w[n,k], b[n])``)
            or ``"addmm"`` (core ATen: ``aten.addmm(b[n], x[m,k], w.t()[k,n])``, what eager ran).
    Returns:
        An ``OpCall`` whose op, arguments and outputs match the measurement, so the store can key the
        row like one of its own measurements.
    """
    dt = row.dtype
    if row.op == "linear":
        out = _spec(row.b, row.m, row.n, dtype=dt)
        if linear_lowering == "addmm":
            args = (_spec(row.n, dtype=dt), _spec(row.b * row.m, row.k, dtype=dt), _transposed(row.k, row.n, dt))
            return OpCall.build(aten.addmm.default, args, {}, (_spec(row.b * row.m, row.n, dtype=dt),))
        if linear_lowering != "linear":
            raise ValueError(f"unknown linear lowering {linear_lowering!r}")
        args = (_spec(row.b, row.m, row.k, dtype=dt), _spec(row.n, row.k, dtype=dt), _spec(row.n, dtype=dt))
        return OpCall.build(aten.linear.default, args, {}, (out,))
    if row.op == "bmm":
        args = (_spec(row.b, row.m, row.k, dtype=dt), _spec(row.b, row.k, row.n, dtype=dt))
        return OpCall.build(aten.bmm.default, args, {}, (_spec(row.b, row.m, row.n, dtype=dt),))
    x = _spec(row.b, row.h, dtype=dt)
    if row.op == "layer_norm":
        stat = _spec(row.b, 1, dtype=dt)
        args = (x, [sympy.Integer(row.h)], _spec(row.h, dtype=dt), _spec(row.h, dtype=dt), LAYER_NORM_EPS)
        return OpCall.build(aten.native_layer_norm.default, args, {}, (x, stat, stat))
    if row.op == "softmax":
        # nn.Softmax() with dim=None on a 2-D input picks dim=1 (torch's legacy _get_softmax_dim).
        return OpCall.build(aten._softmax.default, (x, 1, False), {}, (x,))
    op, second = _ELEMENTWISE_CALLS[row.op]
    args = (x,) if second is None else (x, x if second == "tensor" else SCALAR_OPERAND)
    return OpCall.build(op, args, {}, (x,))


# public op -> (aten overload, second operand: "tensor", "scalar" or None)
_ELEMENTWISE_CALLS: Mapping[str, tuple[torch._ops.OpOverload, Optional[str]]] = {
    "add": (aten.add.Tensor, "tensor"),
    "mul": (aten.mul.Tensor, "tensor"),
    "div": (aten.div.Tensor, "tensor"),
    "pow": (aten.pow.Tensor_Tensor, "tensor"),
    # torch.add(x, 0.5) exports as add.Tensor with a Python scalar ``other``; pow has its own overload.
    "add_scalar": (aten.add.Tensor, "scalar"),
    "mul_scalar": (aten.mul.Tensor, "scalar"),
    "div_scalar": (aten.div.Tensor, "scalar"),
    "pow_scalar": (aten.pow.Tensor_Scalar, "scalar"),
    "relu": (aten.relu.default, None),
    "gelu": (aten.gelu.default, None),
    "tanh": (aten.tanh.default, None),
}


# ---------------------------------------------------------------------------------------------------
# Import into a kernel store
# ---------------------------------------------------------------------------------------------------

RowSink = Callable[[PublicKernelRow, OpCall], Any]


def import_rows(rows: Iterable[PublicKernelRow], sink: RowSink, linear_lowering: str = "linear") -> int:
    """Hand every row, with its OpCall, to ``sink(row, call)``; returns how many were handed over.

    This is the store-agnostic half of the import: the sink decides how a row becomes a record
    (key, provenance columns). Errors from the sink propagate: a row that cannot be stored must fail
    loudly, never be dropped (anti-pattern 10).
    """
    count = 0
    for row in rows:
        sink(row, to_opcall(row, linear_lowering))
        count += 1
    return count


def import_public(store: Any, path: Path | str = DEFAULT_DATA_DIR, batch_size: int = 2000) -> int:
    """Import the public CSVs into a kernel store; the entry point of ``boomfx kernels import``.

    ``store`` is a ``kernels_db.store.Store`` (rows become ``KernelRecord`` s keyed by ``kernel_key`` of
    their OpCall, written in batches with ``put_many``) or any callable sink ``(row, call) -> Any``.
    Returns the number of rows imported.
    """
    if hasattr(store, "put_many"):
        batch: list = []
        count = 0
        for row in iter_public_rows(path):
            batch.append(public_record(row, to_opcall(row)))
            if len(batch) >= batch_size:
                count += store.put_many(batch)
                batch = []
        if batch:
            count += store.put_many(batch)
        return count
    if callable(store):
        return import_rows(iter_public_rows(path), store)
    raise TypeError(f"{type(store).__name__} is neither a Store (put_many) nor a (row, call) callable")


IMPORT_SOURCE = "import:neusight-asplos25"
SAMPLES_PER_LATENCY = 5   # NeuSight reports the mean of the 5 fastest of 25 timings


def public_record(row: PublicKernelRow, call: OpCall) -> Any:
    """The store record of one public row: keyed like boomfx's own measurements, provenance in the fingerprint.

    Only the mean of the fastest timings is published, so p10 = median = p90 = ``latency_ns``; the host
    issue time is not separable (it is inside the latency, see the module's Known limitations).
    """
    from boomfx.kernels_db.keys import kernel_key
    from boomfx.kernels_db.schema import DeviceFingerprint, KernelRecord

    p = row.provenance
    fingerprint = DeviceFingerprint(
        device_name=row.device, device_kind="cuda", torch_version=p.torch_version,
        runtime_version=f"cuda {p.cuda_version}", driver_version="", host="neusight", num_threads=0,
        detail=f"{p.source}; {row.source_device}; cudnn {p.cudnn_version}; tf32 off",
    )
    return KernelRecord(
        fingerprint=fingerprint, key=kernel_key(call), median_ns=row.latency_ns, p10_ns=row.latency_ns,
        p90_ns=row.latency_ns, n_runs=SAMPLES_PER_LATENCY, host_ns=0.0, workspace_bytes=0, source=IMPORT_SOURCE,
    )
