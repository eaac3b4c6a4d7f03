"""Low-precision calls for the GPU kernel model: which calls the tensor-core GEMM and attention models price.

``predict_lowp_ns(call, device, gemms, attention)`` returns ns for

* bf16/fp16 ``mm``/``addmm``/``bmm``/``baddbmm``/``linear`` (tensor-core GEMM, ``tensor_core_gemm.py``;
  a bias epilogue is not priced separately);
* ``aten._scaled_mm`` with fp8 operands (per-tensor scaled, CUTLASS);
* fused SDPA kernels with fp16/bf16 inputs, forward and backward, on the backend the target dispatches
  (``context["sdpa_backend"]``: flash or efficient; the ``*_for_cpu`` ops a CPU trace records are priced as
  the GPU kernel the target would run), through ``attention_model.AttentionModel.sdpa_ns``;

and None for anything else (the fp32 model or the roofline prices it). Sizes must be concrete.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch

from boomfx.core.devices import DeviceSpec
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec, concrete_int, concrete_shape

aten = torch.ops.aten

LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})
FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

# op -> (operand names a, b, batched?)
GEMM_OPERANDS: Mapping[Any, tuple[str, str, bool]] = {
    aten.mm.default: ("self", "mat2", False), aten.addmm.default: ("mat1", "mat2", False),
    aten.bmm.default: ("self", "mat2", True), aten.baddbmm.default: ("batch1", "batch2", True),
    aten._scaled_mm.default: ("self", "mat2", False),
}
SDPA_FORWARD: Mapping[Any, Optional[str]] = {   # op -> backend it implies (None: from the call's context)
    aten.scaled_dot_product_attention.default: None,
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_flash_attention_for_cpu.default: None,
    aten._scaled_dot_product_efficient_attention.default: "efficient",
    aten._scaled_dot_product_cudnn_attention.default: "flash",
    aten._flash_attention_forward.default: "flash",
    aten._efficient_attention_forward.default: "efficient",
}
SDPA_BACKWARD: Mapping[Any, Optional[str]] = {
    aten._scaled_dot_product_flash_attention_backward.default: "flash",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: None,
    aten._scaled_dot_product_efficient_attention_backward.default: "efficient",
    aten._scaled_dot_product_cudnn_attention_backward.default: "flash",
    aten._flash_attention_backward.default: "flash",
    aten._efficient_attention_backward.default: "efficient",
}
BLHE_LAYOUT = frozenset({aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
                         aten._flash_attention_backward.default, aten._efficient_attention_backward.default})


_int = concrete_int      # passes/specs.py
_shape = concrete_shape


def gemm_dims(call: OpCall) -> Optional[tuple[str, torch.dtype, int, int, int, int]]:
    """(precision, operand dtype, b, m, n, k) of a low-precision GEMM call, else None."""
    if call.op is aten.linear.default:
        x, w = call.arg("input"), call.arg("weight")
        if not isinstance(x, TensorSpec) or x.dtype not in LOW_PRECISION:
            return None
        xs, ws = _shape(x), _shape(w)
        return "bf16", x.dtype, 1, int(np.prod(xs[:-1])) if len(xs) > 1 else 1, ws[0], xs[-1]
    names = GEMM_OPERANDS.get(call.op)
    if names is None:
        return None
    a, b = call.arg(names[0]), call.arg(names[1])
    if not isinstance(a, TensorSpec) or not isinstance(b, TensorSpec):
        return None
    if call.op is aten._scaled_mm.default:
        if a.dtype not in FP8:
            return None
        precision = "fp8"
    elif a.dtype in LOW_PRECISION:
        precision = "bf16"
    else:
        return None
    sa, sb = _shape(a), _shape(b)
    if names[2]:
        return precision, a.dtype, sa[0], sa[1], sb[2], sa[2]
    return precision, a.dtype, 1, sa[0], sb[1], sa[1]


def attention_problem(call: OpCall) -> Optional[dict]:
    """Keyword arguments of ``AttentionModel.sdpa_ns`` for a fused fp16/bf16 SDPA call, else None."""
    backward = call.op in SDPA_BACKWARD
    implied = SDPA_BACKWARD.get(call.op) if backward else SDPA_FORWARD.get(call.op, "none")
    if implied == "none":
        return None
    backend = call.context.get("sdpa_backend") or implied or "flash"
    if backend == "cudnn":
        backend = "flash"
    if backend not in ("flash", "efficient"):
        return None
    q, k, v = call.arg("query"), call.arg("key"), call.arg("value")
    if not all(isinstance(t, TensorSpec) for t in (q, k, v)) or q.dtype not in LOW_PRECISION:
        return None
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    if call.op in BLHE_LAYOUT:
        if len(qs) != 4:
            return None   # packed varlen: priced by the roofline (max lengths only)
        batch_heads, q_len, kv_len = qs[0] * qs[2], qs[1], ks[1]
    else:
        batch_heads, q_len, kv_len = int(np.prod(qs[:-2])), qs[-2], ks[-2]
    causal = bool(call.arg("is_causal")) or (call.arg("custom_mask_type") or 0) != 0
    window = call.arg("window_size_left")
    window_left = _int(window) if window is not None and _int(window) >= 0 else None
    return {"batch_heads": batch_heads, "q_len": q_len, "kv_len": kv_len, "head_dim": qs[-1],
            "head_dim_v": vs[-1], "causal": causal, "backward": backward, "backend": backend,
            "window_left": window_left}


def predict_lowp_ns(call: OpCall, device: DeviceSpec, gemms: Any, attention: Any) -> Optional[float]:
    """ns of one low-precision GEMM or fused attention call on ``device``; None when not covered."""
    if device.kind != "cuda" or device.sm_count <= 0:
        return None
    dims = gemm_dims(call)
    if dims is not None:
        precision, dtype, b, m, n, k = dims
        t = gemms.gemm_ns(precision, b, m, n, k, device, dtype)
        return None if t is None else float(t)
    problem = attention_problem(call)
    if problem is not None and attention is not None:
        return attention.sdpa_ns(device=device, **problem)
    return None
