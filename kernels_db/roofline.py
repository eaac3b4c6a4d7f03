"""The analytic last resort: a roofline time from a call's Cost and the device's datasheet.

    time_ns = max(flops / (peak_flops_per_s * eff[class]), bytes / (bandwidth * eff["memory"])) * 1e9
              + kernel_launch_ns

1. The op class (matmul / conv / attention / memory) comes from the op object (sets of aten packets,
   never name strings); the class picks the efficiency from ``DeviceSpec.efficiency`` (data, never a
   literal here) and whether tensor-core peaks apply.
2. The compute dtype is the first floating tensor argument's dtype; fp32 matmuls use the fp32 peak
   (``DeviceSpec.peak_for``), TF32 only when the call's context says ``allow_tf32=True``.
3. Memory-class ops use the non-tensor-core peak for their (few) FLOPs and the "memory" efficiency
   for both terms.

Example::

    >>> roofline_ns(call, cost, get_device("h100"))      # doctest: +SKIP
    1.2e6

Known limitations:
- NB: no tile/wave quantization, no L2 reuse, no launch-bound regime beyond ``kernel_launch_ns``;
  that is why the database (measured > interpolated > model) comes first.
"""

from __future__ import annotations

from typing import Optional

import torch

from boomfx.core.devices import DeviceSpec
from boomfx.passes.costs.registry import Cost, OpCall

aten = torch.ops.aten
NS_PER_S = 1e9


# The op classes live with the kernel pass (one table for passes, fusion, lookup and roofline).
from boomfx.passes.kernels import op_class  # noqa: E402  (re-exported for kernels_db users)


def compute_dtype(call: OpCall) -> torch.dtype:
    for spec in call.tensor_args():
        if spec.dtype.is_floating_point:
            return spec.dtype
    return torch.float32


def peak_flops_per_s(call: OpCall, device: DeviceSpec, klass: str) -> float:
    dtype = compute_dtype(call)
    tensor_op = klass != "memory"
    if (
        dtype == torch.float32
        and tensor_op
        and call.context.get("allow_tf32")
        and device.tf32_flops_per_s > 0
    ):
        return device.tf32_flops_per_s
    return device.peak_for(dtype, tensor_op=tensor_op)


def roofline_ns(call: OpCall, cost: Cost, device: DeviceSpec, klass: Optional[str] = None) -> float:
    """Roofline time of one kernel in ns, launch latency included; the cost must have no free symbols."""
    klass = klass or op_class(call.op)
    flops, bytes_read, bytes_written = cost.evaluate()
    compute_eff = device.efficiency[klass]
    memory_eff = device.efficiency["memory"]
    compute_ns = flops / (peak_flops_per_s(call, device, klass) * compute_eff) * NS_PER_S
    memory_ns = (bytes_read + bytes_written) / (device.memory_bandwidth_bytes_per_s * memory_eff) * NS_PER_S
    return max(compute_ns, memory_ns) + device.kernel_launch_ns
