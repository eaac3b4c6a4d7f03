"""A calibrated GPU kernel-time model: tile/wave GEMMs and bandwidth curves, better than a roofline.

``GpuKernelModel.load()`` reads fitted parameters (``kernels_db/data/gpu_calibration.json``, written by
``fit_gpu_model.py`` from public measurements); ``predict_ns(call, device)`` prices one ``OpCall`` on one
``DeviceSpec``; ``transfer_ns`` carries a measurement from one GPU to another kernel by kernel. The
formulas and their derivation live in ``gpu_model_core.py``.

Example::

    model = GpuKernelModel.load()
    t_ns = model.predict_ns(call, get_device("a100-pcie-40gb"))            # None if no model for the op
    t_h100_ns = model.transfer_ns(measured_ns, call, get_device("a100-pcie-40gb"), get_device("h100-sxm"))

Devices with measurements use their own fitted parameters; any other GPU uses the generic
(device-independent) parameters scaled by its datasheet peak, bandwidth and SM count, with the GEMM
``e_max`` from the fitted trend in board power per TFLOP and bytes per FLOP (``gemm_e_max_trend`` in the
JSON; a GPU without a board power on record keeps the median e_max).

Known limitations:

* fp32 without TF32 from the NeuSight data; bf16/fp16/fp8 GEMMs and fused fp16/bf16 attention from the
  low-precision data (``lowp_pricing.py``, ``tensor_core_gemm.py``, ``attention_model.py``). Other
  low-precision ops (elementwise, norms) get ``None`` here.
* ``floor_ns`` includes torch 2.1 eager host dispatch (the source timed isolated ops with CUDA events);
  in a busy stream part of it would overlap. NB: small-tensor memory ops (< 50 MB) are extrapolated.
* No L2 residency: on the L4 (48 MB L2) some layer norm / softmax rows ran faster than DRAM allows;
  the model stays at the DRAM roofline there by design.
* The GEMM model takes the best candidate tile; cuBLAS's heuristic sometimes picks worse ones.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from boomfx.core.devices import DeviceSpec
from boomfx.kernels_db import gpu_model_core as core
from boomfx.kernels_db.gpu_model_core import GemmParams, MemoryParams
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec, concrete_int, concrete_shape

aten = torch.ops.aten
CALIBRATION_PATH = Path(__file__).parent / "data" / "gpu_calibration.json"


# ---------------------------------------------------------------------------------------------------
# What an OpCall is, for this model: op object -> family (rules as data, keyed by op objects)
# ---------------------------------------------------------------------------------------------------

GEMM_FAMILY: Mapping[Any, str] = {
    aten.mm.default: "linear", aten.addmm.default: "linear", aten.linear.default: "linear",
    aten.bmm.default: "bmm", aten.baddbmm.default: "bmm",
}
# Elementwise packets -> calibration class when the second operand is a tensor / a Python scalar.
ELEMENTWISE_CLASS: Mapping[Any, tuple[str, str]] = {
    aten.add: ("add", "add_scalar"), aten.sub: ("add", "add_scalar"), aten.rsub: ("add", "add_scalar"),
    aten.mul: ("mul", "mul_scalar"), aten.div: ("div", "div_scalar"), aten.pow: ("pow", "pow_scalar"),
    aten.relu: ("relu", "relu"), aten.gelu: ("gelu", "gelu"), aten.tanh: ("tanh", "tanh"),
}
# Other pointwise ops priced by the pooled ``elementwise`` curve (same streaming kernel template).
POOLED_ELEMENTWISE: frozenset = frozenset({
    aten.sigmoid, aten.silu, aten.exp, aten.log, aten.neg, aten.abs, aten.sqrt, aten.rsqrt, aten.clone,
    aten.where, aten.maximum, aten.minimum, aten.clamp, aten.clamp_min, aten.threshold_backward,
    aten.gelu_backward, aten.sigmoid_backward, aten.tanh_backward, aten.reciprocal, aten.copy,
})
NORM_CLASS: Mapping[Any, str] = {
    aten.native_layer_norm.default: "layer_norm", aten.layer_norm.default: "layer_norm",
    aten._softmax.default: "softmax", aten.softmax.int: "softmax",
}


@dataclass(frozen=True)
class GemmProblem:
    family: str
    b: int
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class MemoryProblem:
    op_class: str
    nbytes: int
    row: int


_int = concrete_int      # passes/specs.py
_shape = concrete_shape


def _fp32_only(call: OpCall) -> bool:
    tensors = call.tensor_args() + call.tensor_outputs()
    return bool(tensors) and all(t.dtype == torch.float32 for t in tensors)


def gemm_problem(call: OpCall) -> Optional[GemmProblem]:
    """(b, m, n, k) of a matmul-family call: output [b, m, n], contraction k."""
    family = GEMM_FAMILY.get(call.op)
    if family is None:
        return None
    if call.op is aten.linear.default:
        x, w = _shape(call.arg("input")), _shape(call.arg("weight"))
        m = int(np.prod(x[:-1])) if len(x) > 1 else 1
        return GemmProblem(family, 1, m, w[0], x[-1])
    if family == "linear":
        a, bm = _shape(call.arg("mat1" if call.op is aten.addmm.default else "self")), _shape(call.arg("mat2"))
        return GemmProblem(family, 1, a[0], bm[1], a[1])
    a = _shape(call.arg("batch1" if call.op is aten.baddbmm.default else "self"))
    bm = _shape(call.arg("batch2" if call.op is aten.baddbmm.default else "mat2"))
    return GemmProblem(family, a[0], a[1], bm[2], a[2])


def memory_problem(call: OpCall) -> Optional[MemoryProblem]:
    """Class, bytes moved (tensor inputs read once, outputs written once) and row length."""
    packet = call.op.overloadpacket
    if call.op in NORM_CLASS:
        op_class = NORM_CLASS[call.op]
    elif packet in ELEMENTWISE_CLASS:
        tensor_operands = [v for v in call.args.values() if isinstance(v, TensorSpec)]
        op_class = ELEMENTWISE_CLASS[packet][0 if len(tensor_operands) > 1 else 1]
    elif packet in POOLED_ELEMENTWISE:
        op_class = "elementwise"
    else:
        return None
    nbytes = sum(_int(t.nbytes) for t in call.tensor_args()) + sum(_int(t.nbytes) for t in call.tensor_outputs())
    outs = call.tensor_outputs()
    row = _shape(outs[0])[-1] if outs and outs[0].ndim else 1
    return MemoryProblem(op_class, nbytes, row)


# ---------------------------------------------------------------------------------------------------
# Calibration data
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceCalibration:
    gemm: Mapping[str, GemmParams] = field(default_factory=dict)
    memory: Mapping[str, MemoryParams] = field(default_factory=dict)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "DeviceCalibration":
        gemm = {k: GemmParams(**v) for k, v in d.get("gemm", {}).items()}
        memory = {k: MemoryParams(v["floor_ns"], tuple(v["log2_row_knots"]), tuple(v["inv_efficiency"]))
                  for k, v in d.get("memory", {}).items()}
        return DeviceCalibration(gemm, memory)


# the models read, by (file, modification time) of both files (``GpuKernelModel.load``); a model is not
# edited once read (``without_device`` makes another)
_LOADED: dict[tuple, "GpuKernelModel"] = {}


class GpuKernelModel:
    """Predicts fp32 kernel times from fitted per-device parameters, or generic ones scaled by datasheet."""

    def __init__(self, devices: Mapping[str, DeviceCalibration], generic: DeviceCalibration,
                 e_max_trend: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 board_power_w: Optional[Mapping[str, float]] = None,
                 memory_by_class: Optional[Mapping[str, DeviceCalibration]] = None,
                 lowp: Optional[Any] = None, attention: Optional[Any] = None) -> None:
        self.devices = dict(devices)
        self.lowp = lowp              # tensor_core_gemm.LowpCalibration (bf16/fp16/fp8 GEMMs)
        self.attention = attention    # attention_model.AttentionModel (fused SDPA kernels)
        self.generic = generic
        self.e_max_trend = dict(e_max_trend or {})
        self.board_power_w = dict(board_power_w or {})
        self.memory_by_class = dict(memory_by_class or {})   # "hbm"/"gddr" -> generic memory params

    @staticmethod
    def load(path: Optional[Path | str] = None, lowp_path: Optional[Path | str] = None) -> "GpuKernelModel":
        """The fp32 model of ``path`` with the low-precision GEMM and attention models of ``lowp_path``.

        Kept per pair of files as they are on disk (path and modification time): every CUDA pricer reads
        it, and a ``--search`` makes one pricer per analysis (128 reads of the same 2 files were 2.8 s)."""
        from boomfx.kernels_db.tensor_core_gemm import LOWP_CALIBRATION_PATH
        files = (Path(path or CALIBRATION_PATH), Path(lowp_path or LOWP_CALIBRATION_PATH))
        key = tuple((str(f.resolve()), f.stat().st_mtime_ns) for f in files)
        if key not in _LOADED:
            _LOADED[key] = GpuKernelModel._read(*files)
        return _LOADED[key]

    @staticmethod
    def _read(path: Path, lowp_path: Path) -> "GpuKernelModel":
        from boomfx.kernels_db.attention_model import AttentionModel
        from boomfx.kernels_db.tensor_core_gemm import LowpCalibration
        with open(path) as fh:
            model = GpuKernelModel.from_json(json.load(fh))
        with open(lowp_path) as fh:
            lowp_doc = json.load(fh)
        model.lowp = LowpCalibration.from_json(lowp_doc)
        model.attention = AttentionModel.from_json(lowp_doc)
        return model

    @staticmethod
    def from_json(doc: Mapping[str, Any]) -> "GpuKernelModel":
        devices = {name: DeviceCalibration.from_json(d) for name, d in doc["devices"].items()}
        generic = doc["generic"]
        by_class = {cls: DeviceCalibration.from_json({"memory": memory})
                    for cls, memory in generic.get("memory_by_class", {}).items()}
        return GpuKernelModel(devices, DeviceCalibration.from_json(generic), generic.get("gemm_e_max_trend"),
                              generic.get("board_power_w"), by_class)

    def without_device(self, name: str) -> "GpuKernelModel":
        """The same model with one device's own parameters dropped (it falls back to the generic set)."""
        return GpuKernelModel({k: v for k, v in self.devices.items() if k != name}, self.generic,
                              self.e_max_trend, self.board_power_w, self.memory_by_class, self.lowp,
                              self.attention)

    # -- parameter lookup: the device's own, else generic; a family falls back to its sibling --------
    def gemm_params(self, family: str, device: DeviceSpec) -> Optional[GemmParams]:
        for cal in (self.devices.get(device.name), self.generic):
            if cal is None:
                continue
            for fam in (family, "linear", "bmm"):
                if fam in cal.gemm:
                    if cal is self.generic:
                        return self._generic_for(fam, cal.gemm[fam], device)
                    return cal.gemm[fam]
        return None

    def _generic_for(self, family: str, params: GemmParams, device: DeviceSpec) -> GemmParams:
        """Generic parameters with e_max from the fitted datasheet trend (``fit_gpu_model._e_max_trend``).

        A device missing a datasheet figure the trend needs (no board power on record) keeps the median.
        """
        fit = self.e_max_trend.get(family)
        if not fit:
            return params
        features = core.device_features(device.peak_flops_per_s[torch.float32], device.memory_bandwidth_bytes_per_s,
                                        self.board_power_w.get(device.name))
        log_e_max = core.trend_log_e_max(fit, features)
        return params if log_e_max is None else replace(params, e_max=float(np.exp(log_e_max)))

    def memory_params(self, op_class: str, device: DeviceSpec) -> Optional[MemoryParams]:
        """The device's own fit (its op class, else its elementwise fit); else the generic fit of the op
        class, from the device's DRAM class (HBM/GDDR) where that was kept, then the elementwise one."""
        own = self.devices.get(device.name)
        dram = self.memory_by_class.get(device.memory_class)
        tiers = [(own, op_class), (own, "elementwise"), (dram, op_class), (self.generic, op_class),
                 (dram, "elementwise"), (self.generic, "elementwise")]
        for cal, cls in tiers:
            if cal is not None and cls in cal.memory:
                return cal.memory[cls]
        return None

    # -- predictions -----------------------------------------------------------------------------
    def predict_gemm_ns(self, problem: GemmProblem, device: DeviceSpec, launch_floor: bool = False) -> Optional[float]:
        params = self.gemm_params(problem.family, device)
        if params is None:
            return None
        if launch_floor:
            params = replace(params, floor_ns=device.kernel_launch_ns)
        t = core.gemm_time_ns(problem.b, problem.m, problem.n, problem.k,
                              peak_flops_per_s=device.peak_flops_per_s[torch.float32],
                              bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
                              sm_count=device.sm_count, params=params)
        return float(t)

    def predict_memory_ns(self, problem: MemoryProblem, device: DeviceSpec, launch_floor: bool = False) -> Optional[float]:
        params = self.memory_params(problem.op_class, device)
        if params is None:
            return None
        if launch_floor:
            params = replace(params, floor_ns=device.kernel_launch_ns)
        t = core.memory_time_ns(problem.nbytes, problem.row,
                                bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s, params=params)
        return float(t)

    def predict_ns(self, call: OpCall, device: DeviceSpec, launch_floor: bool = False) -> Optional[float]:
        """Predicted GPU time of one call (ns), or None when no model covers the op, dtype or device.

        Sizes must be concrete (bind symbols first). Never faster than ``max(flops/peak, bytes/bw)``.
        ``launch_floor=True`` replaces the fitted floor (which includes torch 2.1's host dispatch, as
        the public data timed isolated eager ops) by the device's kernel launch latency: the scheduler
        models host issue separately, so the floor must not be counted twice.
        """
        if device.kind != "cuda" or device.sm_count <= 0:
            return None
        if self.lowp is not None:
            from boomfx.kernels_db.lowp_pricing import predict_lowp_ns
            lowp_ns = predict_lowp_ns(call, device, self.lowp, self.attention)
            if lowp_ns is not None:
                return lowp_ns   # its floor is GPU-side already (CUDA-graph timings): launch_floor not applied
        if _fp32_only(call):
            gemm = gemm_problem(call)
            if gemm is not None:
                return self.predict_gemm_ns(gemm, device, launch_floor)
            mem = memory_problem(call)
            if mem is not None:
                return self.predict_memory_ns(mem, device, launch_floor)
        if gemm_problem(call) is not None:
            return None   # a GEMM at a precision neither model covers (e.g. fp32 with TF32 context)
        return self.predict_bandwidth_class_ns(call, device, launch_floor)

    def predict_bandwidth_class_ns(self, call: OpCall, device: DeviceSpec, launch_floor: bool = False) -> Optional[float]:
        """A memory-bound kernel at any dtype on its class's fitted curve, by the bytes it moves
        (``bandwidth_classes.py``: casts, foreach/fused optimizer kernels, fp32 loss softmax, grad scaler)."""
        from boomfx.kernels_db.bandwidth_classes import bandwidth_problem
        problem = bandwidth_problem(call)
        if problem is None:
            return None
        return self.predict_memory_ns(MemoryProblem(*problem), device, launch_floor)

    def transfer_ns(self, measured_ns: float, call: OpCall, source: DeviceSpec, target: DeviceSpec) -> float:
        """Carry a measurement on ``source`` to ``target``: ``measured * model(target) / model(source)``.

        Shape effects the model misses on the source (a cuBLAS kernel choice, an odd size) carry over
        as the ratio. Same device: the measurement, exactly. When the model has no rule for the op, the
        ratio of datasheet bandwidths is used (NB: assumes the op is memory-bound).
        """
        if source.name == target.name:
            return float(measured_ns)
        src = self.predict_ns(call, source)
        dst = self.predict_ns(call, target)
        if src is None or dst is None or src <= 0:
            return float(measured_ns) * source.memory_bandwidth_bytes_per_s / target.memory_bandwidth_bytes_per_s
        return float(measured_ns) * dst / src


# ---------------------------------------------------------------------------------------------------
# Baselines the benchmark compares against
# ---------------------------------------------------------------------------------------------------

def call_flops_and_bytes(call: OpCall) -> tuple[float, float]:
    """FLOPs (2*b*m*n*k for GEMMs, 0 otherwise) and bytes of tensor inputs + outputs."""
    nbytes = float(sum(_int(t.nbytes) for t in call.tensor_args()) + sum(_int(t.nbytes) for t in call.tensor_outputs()))
    gemm = gemm_problem(call)
    flops = 2.0 * gemm.b * gemm.m * gemm.n * gemm.k if gemm else 0.0
    return flops, nbytes


def roofline_ns(call: OpCall, device: DeviceSpec) -> float:
    """Plain datasheet roofline: ``max(flops / fp32 peak, bytes / bandwidth)``, no efficiency, no floor."""
    flops, nbytes = call_flops_and_bytes(call)
    return max(flops / device.peak_flops_per_s[torch.float32], nbytes / device.memory_bandwidth_bytes_per_s) * 1e9


# PyTorch's torch.utils._runtime_estimation.flops_to_ns: MACs (= FLOPs / 2) at 75% of peak.
PYTORCH_PEAK_FRACTION = 0.75
PYTORCH_FLOPS_PER_MAC = 2.0


def pytorch_estimator_ns(call: OpCall, device: DeviceSpec) -> float:
    """PyTorch's RuntimeEstimator roofline rule ``max(compute, transfer)`` with its own conventions.

    compute = (flops / 2) / (0.75 * peak) (it converts FLOPs to MACs), transfer = bytes / bandwidth.
    """
    flops, nbytes = call_flops_and_bytes(call)
    compute_ns = flops / PYTORCH_FLOPS_PER_MAC / (PYTORCH_PEAK_FRACTION * device.peak_flops_per_s[torch.float32]) * 1e9
    return max(compute_ns, nbytes / device.memory_bandwidth_bytes_per_s * 1e9)
