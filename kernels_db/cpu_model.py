"""A CPU kernel's time from this host's measured rates (``host_probe.HostProfile``), for kernels the
database does not hold: the CPU counterpart of the GPU kernel model, consulted before the roofline.

    time_ns = max(bytes / stream_rate(bytes, footprint),     every op
                  flops / gemm_rate(dtype, flops, footprint),  matmul / conv classes
                  flops / attention_rate(keys),              fused SDPA forward / backward
                  (ATen's math path, a CPU attention with dropout: its matmuls, softmax and draws in turn)
                  flops / depthwise_rate(flops),             depthwise convolutions
                  flops / conv_rate(flops),                  oneDNN's other fp32 convolutions (its fixed
                                                             cost held in the curve's small points)
                  elements / special_rate(op, elements, row), exp, tanh, gelu, silu, softmax, ...,
                                                             batch norm (with the batch's statistics: its own),
                                                             and random draws (dropout, randn, ...)
                  steps x ns_per_step + flops / lstm_rate)   oneDNN's LSTM layer (its own probe)

at least the op's probed one-element call (``op_floors_ns``; a convolution's on the path ATen routes it
to, ``cpu_convolution.py``) less the dispatch charged as host time.

The op's dispatch (``HostProfile.dispatch_ns``) is its host time, added by the CPU schedule. The
rates are curves, not peaks: a GEMM of F FLOPs runs at the rate the probe's square GEMM of F FLOPs
reached (small GEMMs run far below the plateau on a CPU), a kernel moving B bytes at the rate a copy
of B bytes reached, both at the cache level the step's footprint leaves its operands in
(``HostProfile`` levels: a tensor is reused after about the step's footprint of other bytes). Known limitations: a GEMM's aspect ratio (a skinny
``[tokens, hidden] @ [hidden, 4 hidden]`` packs differently from a square one of the same FLOPs), and
the in-step effects the database's in-step prices hold (what the kernel before left in the caches);
transposed convolutions stay at the GEMM's rate (alone here they ran -72..+89% off it, and off the forward
convolution curve alike: ``benchmarks/results/cpu_conv_shapes.md``).
The pages an op's fresh outputs fault are the step's, not the op's (they depend on what glibc's heap holds
then): ``Analysis`` charges them from ``boomfx/memory/glibc_heap.py``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from boomfx.core.devices import DeviceSpec
from boomfx.passes.costs.norms import uses_batch_statistics
from boomfx.passes.costs.recurrent import lstm_layer_dims
from boomfx.passes.costs.registry import OpCall, price_call

from boomfx.kernels_db.cpu_convolution import ONEDNN, floor_key, route
from boomfx.kernels_db.host_probe import HostProfile, _interp, _rate_at
from boomfx.kernels_db.in_step_calibration import ratios_by_bound
from boomfx.kernels_db.roofline import compute_dtype, op_class

aten = torch.ops.aten
COMPUTE_CLASSES = ("matmul", "conv")
# what bounds a looped price (``CpuKernelModel.bound``): the probe's in-step ratios are per bound
BOUND_MATMUL, BOUND_ARITHMETIC, BOUND_MEMORY = "matmul", "arithmetic", "memory"
BOUNDS = (BOUND_MATMUL, BOUND_ARITHMETIC, BOUND_MEMORY)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ATTENTION_BACKWARD = frozenset({aten._scaled_dot_product_flash_attention_for_cpu_backward,
                                 aten._scaled_dot_product_flash_attention_backward,
                                 aten._scaled_dot_product_efficient_attention_backward,
                                 aten._scaled_dot_product_cudnn_attention_backward})


class CpuKernelModel:
    """``(call, device) -> ns`` over one ``HostProfile`` (the ``model`` hook of ``KernelPricer``), at the
    cache level of a step of ``footprint_bytes`` (set per evaluated point by ``Analysis``; None: warm)."""

    def __init__(self, profile: HostProfile) -> None:
        self.profile = profile
        self.footprint_bytes: Optional[int] = None
        # bound -> (looped ns, in-step ratio) by band of time, from the probe's calibration step
        self.in_step_ratios: dict[str, tuple[tuple[float, float], ...]] = (
            ratios_by_bound(profile.in_step, self.bound) if profile.in_step else {})
        # the calls priced next run in ATen's own C++ loop (a recurrent layer's cell ops, ``Analysis``): no
        # Python or other kernels between them, so they stay hot as in the probe's loops (no in-step ratio)
        self.in_loop = False

    @property
    def context_key(self) -> tuple[Optional[int], bool]:
        """What the prices depend on beyond the call (``KernelPricer`` memoizes per call and this)."""
        return self.footprint_bytes, self.in_loop

    def __call__(self, call: OpCall, device: DeviceSpec) -> Optional[float]:
        """The call's kernel time inside a step: its looped price at the step's cache level, or its warm
        looped price scaled by the probe's in-step ratio of what bounds it at its time
        (``HostProfile.in_step``, ``in_step_calibration.py``), whichever is longer (a cold level already
        holds the operands' misses the ratio holds: the two do not compound)."""
        looped = self._looped(call, self.footprint_bytes)
        if looped is None:
            return None
        ns, _ = looped
        warm, bound = looped if self.footprint_bytes is None else self._looped(call, None)
        ratios = None if self.in_loop else self.in_step_ratios.get(bound)
        if not ratios:
            return ns
        dispatch = self.profile.dispatch_ns      # the ratio is of whole calls, the dispatch included
        return max(ns, (warm + dispatch) * _interp(ratios, warm + dispatch) - dispatch)

    def bound(self, call: OpCall) -> Optional[str]:
        """What bounds the call's warm looped price: ``BOUND_MATMUL`` (a GEMM's or an attention's rate),
        ``BOUND_ARITHMETIC`` (a convolution's, a special function's or a norm's rate) or ``BOUND_MEMORY``
        (its bytes, or its one-element floor); None when it cannot be priced."""
        looped = self._looped(call, None)
        return looped[1] if looped is not None else None

    def _looped(self, call: OpCall, footprint: Optional[int]) -> Optional[tuple[float, str]]:
        """The call's kernel time as the probe measures kernels, looped, at the cache level of a step of
        ``footprint`` bytes (None: warm), and what bounds it (``bound``)."""
        try:
            flops, read, written = price_call(call).cost.evaluate()
        except ValueError:
            return None
        moved = float(read + written)
        terms = [(moved / self.profile.stream_rate(moved, footprint) * 1e9 if moved > 0 else 0.0, BOUND_MEMORY),
                 (self.floor_ns(call), BOUND_MEMORY)]
        klass = op_class(call.op)
        conv_curve = self.conv_curve(call) if flops > 0 else ()
        if flops > 0 and _is_depthwise(call):
            terms.append((flops / _rate_at(self.profile.depthwise_conv, float(flops)) * 1e9, BOUND_ARITHMETIC))
        elif conv_curve:
            terms.append((flops / _rate_at(conv_curve, float(flops)) * 1e9, BOUND_ARITHMETIC))
        elif flops > 0 and klass in COMPUTE_CLASSES:
            dtype = _DTYPE_NAMES.get(compute_dtype(call), "float32")
            terms.append((flops / self.profile.gemm_rate(dtype, float(flops), footprint) * 1e9,
                          BOUND_MATMUL if klass == "matmul" else BOUND_ARITHMETIC))
        elif flops > 0 and klass == "attention" and call.context.get("sdpa_backend") == "math":
            return max((self._math_attention_ns(call, flops, terms[0][0], footprint), BOUND_MATMUL), terms[1])
        elif flops > 0 and klass == "attention":
            backward = call.op.overloadpacket in _ATTENTION_BACKWARD
            keys = _dim(call.arg("key"), -2) or _dim(call.arg("query"), -2) or 256
            terms.append((flops / self.profile.attention_rate(float(keys), backward) * 1e9, BOUND_MATMUL))
        if call.op.overloadpacket in _FUSED_LSTM:
            return max(*terms, (self._lstm_layer_ns(call, flops, footprint), BOUND_MATMUL))
        rate = self.special_rate(call)
        if rate:
            terms.append((sum(_numel(spec) for spec in call.tensor_outputs()) / rate * 1e9, BOUND_ARITHMETIC))
        return max(terms)

    def _math_attention_ns(self, call: OpCall, flops: int, bytes_ns: float, footprint: Optional[int]) -> float:
        """SDPA on ATen's math path (a CPU attention with dropout): its kernels run one after another, the
        two batched matmuls at the GEMM rate, the softmax over the ``[BH, L, S]`` scores at its rate or
        the path's bytes, and the dropout's draws over the scores at the random-number rate."""
        q, k = call.arg("query"), call.arg("key")
        scores = _numel(q) // max(_dim(q, -1), 1) * _dim(k, -2)
        dtype = _DTYPE_NAMES.get(compute_dtype(call), "float32")
        rates = self.profile.special_elements_per_s
        ns = flops / self.profile.gemm_rate(dtype, flops / 2.0, footprint) * 1e9
        softmax = self.rate_of("_softmax", float(scores), _dim(k, -2))
        ns += max(bytes_ns, scores / softmax * 1e9 if softmax else 0.0)
        dropout = rates.get("bernoulli_")
        if (call.arg("dropout_p") or 0) > 0 and dropout:
            ns += scores / dropout * 1e9
        return ns

    def _lstm_layer_ns(self, call: OpCall, flops: int, footprint: Optional[int]) -> float:
        """oneDNN's LSTM layer at the probe's cost per step plus its FLOPs at the probe's rate for the pass
        (``HostProfile.lstm_layer``: inference, training forward, backward). A profile without it: the input
        projection as one GEMM over every step, one small recurrent GEMM per step (each at the GEMM curve's
        rate of its FLOPs) and the gates at the sigmoid's element rate, the backward twice the products."""
        steps, batch, width, hidden = (int(v) for v in lstm_layer_dims(call))
        backward = call.op.overloadpacket is aten.mkldnn_rnn_layer_backward
        measured = self.profile.lstm_layer.get(
            "backward" if backward else "forward_train" if call.arg("train") else "forward")
        if measured is not None:
            per_step, rate = measured
            return steps * per_step + flops / rate * 1e9
        dtype = _DTYPE_NAMES.get(compute_dtype(call), "float32")
        projection = 2.0 * steps * batch * width * 4 * hidden
        recurrent = 2.0 * batch * hidden * 4 * hidden
        products = (projection / self.profile.gemm_rate(dtype, projection, footprint)
                    + steps * recurrent / self.profile.gemm_rate(dtype, recurrent, footprint)) * 1e9
        gates = self.profile.special_elements_per_s.get("sigmoid")
        cell = 5.0 * steps * batch * hidden / gates * 1e9 if gates else 0.0
        return products * (2 if backward else 1) + cell

    def conv_curve(self, call: OpCall) -> tuple:
        """The probe's oneDNN convolution curve a call is priced on (``HostProfile.conv``): a float32,
        non-depthwise convolution or convolution backward that ATen sends to oneDNN
        (``cpu_convolution.route``), on the 1x1 curve when every kernel dimension is 1, else the 3x3 one
        (a grouped convolution at its FLOPs on the dense curve); () for any other call (a GEMM's rate)."""
        if not self.profile.conv or route(call, self.profile.threads) != ONEDNN:
            return ()
        if compute_dtype(call) != torch.float32:
            return ()
        try:
            kernel = [int(d) for d in call.arg("weight").shape[2:]]
        except (AttributeError, TypeError, ValueError):
            return ()
        if not kernel:
            return ()
        size = "1x1" if all(d == 1 for d in kernel) else "3x3"
        phase = "backward" if call.op.overloadpacket is aten.convolution_backward else "forward"
        return self.profile.conv.get(f"{phase}@{size}", ())

    def special_rate(self, call: OpCall) -> Optional[float]:
        """Elements/s of an arithmetic-bound op (None: priced by its bytes) at its size: on the probe's curve
        of the op at the call's output elements (``HostProfile.special_curves``), a row-wise op's scaled by
        its row length's factor (``row_factors``); a profile without curves, the op's 1M-element rate. GELU's
        tanh approximation (``approximate="tanh"``) reads its own kernel's rate. A dropout in eval mode
        (``train=False``) draws nothing: ATen returns its input (or a copy), priced by its bytes."""
        rates = self.profile.special_elements_per_s
        name = call.op.overloadpacket.__name__
        if name in _DROPOUTS and call.arg("train") is False:
            return None
        if call.arg("approximate") == "tanh" and f"{name}@tanh" in rates:
            name = f"{name}@tanh"
        elif name in _BATCH_NORMS and "batch_norm@train" in rates and uses_batch_statistics(call):
            name = "batch_norm@train"
        elements = float(sum(_numel(spec) for spec in call.tensor_outputs()))
        return self.rate_of(name, elements, _row_length(call) if name in self.profile.row_factors else 0)

    def rate_of(self, name: str, elements: float, row: int = 0) -> Optional[float]:
        """Elements/s of the probe's ``name`` kernel over ``elements`` (rows of ``row``; 0: not row-wise)."""
        curve = self.profile.special_curves.get(name)
        if not curve:
            return self.profile.special_elements_per_s.get(name)
        rate = _rate_at(curve, max(elements, 1.0))
        factors = self.profile.row_factors.get(name)
        return rate * _interp(factors, float(row)) if factors and row > 0 else rate

    def floor_ns(self, call: OpCall) -> float:
        """The op's one-element call less the dispatch charged as its host time; a convolution's on the
        path ATen routes it to (``cpu_convolution.floor_key``: oneDNN's is ~8x the native one's)."""
        floors = self.profile.op_floors_ns
        key = floor_key(call, self.profile.threads)
        floor = floors.get(key) if key is not None else None
        if floor is None:
            floor = floors.get(call.op.overloadpacket.__name__, 0.0)
        return floor - self.profile.dispatch_ns

_DROPOUTS = frozenset({"dropout", "native_dropout"})
# batch norms that run ATen's CPU kernel with the batch's statistics when training (their own probe rate)
_BATCH_NORMS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                          "_native_batch_norm_legit_functional", "_batch_norm_with_update"})
_FUSED_LSTM = frozenset({aten.mkldnn_rnn_layer, aten.mkldnn_rnn_layer_backward})


def _dim(spec: object, i: int) -> int:
    shape = getattr(spec, "shape", ())
    try:
        return int(shape[i]) if len(shape) >= abs(i) else 0
    except TypeError:
        return 0


def _is_depthwise(call: OpCall) -> bool:
    """A grouped convolution with one input channel per group (``weight [C, 1, kh, kw]``, groups = C > 1)."""
    if call.op.overloadpacket not in (aten.conv2d, aten.convolution, aten.conv1d):
        return False
    groups = call.arg("groups")
    try:
        return int(groups) > 1 and _dim(call.arg("weight"), 1) == 1
    except (TypeError, ValueError):
        return False


def _row_length(call: OpCall) -> int:
    """The length of the rows a norm or softmax reduces over: the normalized shape's elements of a layer norm
    (forward or backward), the reduced dimension's size of a softmax; 0 when not known."""
    if call.arg("normalized_shape") is not None:
        return _product(call.arg("normalized_shape"))
    dim = call.arg("dim")
    try:
        return _dim(call.arg("self") if call.arg("self") is not None else call.arg("input"), int(dim))
    except (TypeError, ValueError):
        return 0


def _numel(spec: object) -> int:
    return _product(getattr(spec, "shape", ()))


def _product(dims: Sequence[object]) -> int:
    """The product of ``dims`` as ints; 0 when one is not a number (a symbolic size)."""
    n = 1
    for d in dims:
        try:
            n *= int(d)
        except (TypeError, ValueError):
            return 0
    return n
