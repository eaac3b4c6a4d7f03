"""Kernel pass: which nodes launch a kernel on the target, of which class, and which SDPA backend.

Views and bookkeeping ops launch nothing. Scaled-dot-product attention is priced as the variant the
*target* would dispatch (flash needs sm80+ and fp16/bf16; mem-efficient handles fp32 and masks;
otherwise math), not the one the host chose while tracing.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.fx

from boomfx.core.devices import DeviceSpec
from boomfx.passes.aliasing import is_view_node
from boomfx.passes.costs.grouped_mm import LIBRARY_GROUPED_MM_OPS
from boomfx.passes.foreign_ops import library_op_name
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.op_sets import NO_KERNEL_OPS
from boomfx.core.program import META_CONCAT_INTO, Program

aten = torch.ops.aten

OP_CLASS_MATMUL = "matmul"
OP_CLASS_CONV = "conv"
OP_CLASS_ATTENTION = "attention"
OP_CLASS_MEMORY = "memory"
_ATEN_NAMESPACES = ("aten", "prims", "quantized", "torchvision")

def _packets(*names: str) -> frozenset:
    """Op packets by name, skipping those this torch version does not have."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))

_MATMUL = _packets("mm", "addmm", "bmm", "baddbmm", "addbmm", "linear", "matmul", "mv", "addmv", "dot",
                   "_addmm_activation", "_scaled_mm", "_int_mm", "einsum", "_grouped_mm", "_scaled_grouped_mm")
_CONV = _packets("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                 "conv_transpose2d", "conv_transpose3d", "convolution_backward", "cudnn_convolution",
                 "mkldnn_convolution", "_slow_conv2d_forward")
SDPA_OPS = _packets("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                    "_efficient_attention_forward")
_SDPA_BACKWARD = _packets("_scaled_dot_product_flash_attention_backward",
                          "_scaled_dot_product_efficient_attention_backward",
                          "_scaled_dot_product_flash_attention_for_cpu_backward",
                          "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
                          "_efficient_attention_backward")

@dataclass(frozen=True)
class KernelChoice:
    launches: bool
    op_class: str = OP_CLASS_MEMORY
    sdpa_backend: Optional[str] = None

NO_KERNEL = KernelChoice(False, "none")

@dataclass(frozen=True)
class KernelInfo:
    by_node: Mapping[str, KernelChoice]

    def choice(self, node: torch.fx.Node) -> KernelChoice:
        return self.by_node.get(node.name, NO_KERNEL)

def op_class(op: torch._ops.OpOverload) -> str:
    if op.namespace not in _ATEN_NAMESPACES:   # other libraries' ops: matmuls only when known to be
        return OP_CLASS_MATMUL if library_op_name(op) in LIBRARY_GROUPED_MM_OPS else OP_CLASS_MEMORY
    packet = op.overloadpacket
    if packet in _MATMUL:
        return OP_CLASS_MATMUL
    if packet in _CONV:
        return OP_CLASS_CONV
    if packet in SDPA_OPS or packet in _SDPA_BACKWARD:
        return OP_CLASS_ATTENTION
    return OP_CLASS_MEMORY

def sdpa_backend_for(node: torch.fx.Node, device: DeviceSpec) -> str:
    """The backend PyTorch would pick on ``device`` for this attention call (sdp_utils priority order)."""
    q = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    dtype = q.dtype if isinstance(q, torch.Tensor) else torch.float32
    head_dim = q.shape[-1] if isinstance(q, torch.Tensor) else 64
    has_mask = len(node.args) > 3 and node.args[3] is not None or node.kwargs.get("attn_mask") is not None
    if device.kind == "cpu":
        # CPU: the fused flash kernel handles fp32/bf16/fp16 without an arbitrary mask requirement, but
        # not dropout (sdp_utils_cpp's check_for_dropout): a training-mode attention runs the math path
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if isinstance(dropout, (int, float)) and dropout > 0:
            return "math"
        return "flash" if dtype in (torch.float32, torch.bfloat16, torch.float16) else "math"
    low_precision = dtype in (torch.float16, torch.bfloat16)
    try:
        small_head = int(head_dim) <= 256
    except TypeError:
        small_head = True
    if device.supports_flash_attention and low_precision and small_head and not has_mask:
        return "flash"
    if device.supports_mem_efficient_attention:
        return "efficient"
    return "math"

def kernel_pass(program: Program, am: AnalysisManager) -> KernelInfo:
    by_node: dict[str, KernelChoice] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if getattr(target, "boomfx_fused", False):  # compiled execution: one Inductor kernel (passes/compiled.py)
            by_node[node.name] = KernelChoice(True, OP_CLASS_MEMORY)
            continue
        if not isinstance(target, torch._ops.OpOverload) or target.overloadpacket in NO_KERNEL_OPS:
            by_node[node.name] = NO_KERNEL
            continue
        if target.namespace not in _ATEN_NAMESPACES:
            by_node[node.name] = KernelChoice(True, op_class(target))
            continue
        if is_view_node(node) or _concat_written_by_producers(node):
            by_node[node.name] = NO_KERNEL
            continue
        cls = op_class(target)
        backend = None
        if target.overloadpacket in SDPA_OPS or target.overloadpacket in _SDPA_BACKWARD:
            backend = sdpa_backend_for(node, am.device)
        by_node[node.name] = KernelChoice(True, cls, backend)
    return KernelInfo(by_node)

def _concat_written_by_producers(node: torch.fx.Node) -> bool:
    """A compiled ``cat`` whose every non-empty input its producing kernel wrote into the concat buffer
    (``META_CONCAT_INTO``, passes/concat_into.py): Inductor's ConcatKernel is then no kernel at all."""
    written = node.meta.get(META_CONCAT_INTO)
    if not written:
        return False
    positions = {p for p, _, _ in written}
    for p, inp in enumerate(node.args[0]):
        if p in positions or not isinstance(inp, torch.fx.Node):
            continue
        val = inp.meta.get("val")      # anything but an empty input (a repeated one too) is copied
        if not (isinstance(val, torch.Tensor) and any(isinstance(d, int) and d == 0 for d in val.shape)):
            return False
    return True

def is_bookkeeping(node: torch.fx.Node) -> bool:
    """Non-aten call_function nodes (getitem, SymInt arithmetic) that never touch the device."""
    return node.op == "call_function" and (node.target is operator.getitem
                                           or not isinstance(node.target, torch._ops.OpOverload))
