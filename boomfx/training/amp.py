"""GPU execution policy applied while tracing on fake tensors: autocast casts and the SDPA kernel.

Why this module exists: boomfx traces on fake *CPU* tensors (autograd on fake CUDA tensors aborts in
CPU-only builds: it needs CUDA's device guard), so two decisions a GPU makes at dispatch time are
reproduced explicitly, above autograd, exactly where autocast sits:

1. **Autocast.** :class:`CastPolicy` applies CUDA autocast's op lists, copied from
   ``ATen/autocast_mode.h`` (torch 2.13, ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
   ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``), to every op of the export graph before it
   runs: matmul/conv/linear/SDPA inputs cast to the low dtype, norms/losses/exp/log to fp32,
   softmax/sum/cumsum get ``dtype=float32``. Casts of leaf parameters are cached per forward, as
   autocast's weight cache does, so each fp32 master weight is cast once (one ``_to_copy`` node).
2. **Fused attention.** On a GPU, ``scaled_dot_product_attention`` runs the flash or memory-efficient
   kernel; on fake tensors the selector cannot query a device. :func:`gpu_sdpa` calls the fused
   kernels directly, mirroring the order of ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
   (flash, then efficient, then math).

Known limitations:
    - Policy is applied to the ops of the export graph (default ATen IR) and to the loss; ops created
      inside a composite op's decomposition are not re-checked (autocast never sees those either,
      except for composites autocast does not list).
    - ``norm`` overloads with a different redispatch signature and the banned list
      (``binary_cross_entropy``) are not modelled.
    - The SDPA selection is simplified (dtype, head dim, mask and GQA checks; no per-architecture or
      alignment checks; cuDNN attention never chosen).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import traceback as fx_traceback

AMP_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

aten = torch.ops.aten


def parse_amp(amp: str | None) -> torch.dtype | None:
    """``"bf16"``/``"fp16"`` -> dtype; ``None`` -> no autocast."""
    if amp is None:
        return None
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp must be one of {sorted(AMP_DTYPES)} or None, got {amp!r}")
    return AMP_DTYPES[amp]


# CUDA autocast op lists (ATen/autocast_mode.h, torch 2.13). Entries without an overload name
# register the op's default overload only, as KERNEL_CUDA(op, policy) does.
_LOWER = {"_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
          "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
          "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
          "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
          "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
          "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"}
_FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
         "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
         "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
         "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
         "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
         "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
         "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
         "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
         "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
         "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
         "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
         "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"}
_FP32_SET_OPT_DTYPE = {"prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                       "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
                       "sum", "sum.dim_IntList"}
_PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
            "index_put", "tensordot", "scatter_add"}


def _key(op: torch._ops.OpOverload) -> str:
    overload = op._overloadname
    name = op.overloadpacket.__name__
    return name if overload == "default" else f"{name}.{overload}"


def _eligible(t: Any) -> bool:
    # autocast's is_autocast_eligible: floating point, not double.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class CastPolicy:
    """Autocast, as CUDA applies it, for ops called one by one (see module docstring)."""

    def __init__(self, low_dtype: torch.dtype | None) -> None:
        self.low_dtype = low_dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def clear_cache(self) -> None:
        """Autocast clears its weight cache when the outermost autocast region exits."""
        self._cache.clear()

    def _cast(self, t: Any, dtype: torch.dtype) -> Any:
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = t.is_leaf and t.requires_grad
        if cacheable and id(t) in self._cache and self._cache[id(t)][0] is t:
            return self._cache[id(t)][1]
        out = t.to(dtype)
        if cacheable:
            self._cache[id(t)] = (t, out)
        return out

    def apply(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Args and kwargs of ``op`` after autocast's casts (unchanged when AMP is off)."""
        if self.low_dtype is None or not isinstance(op, torch._ops.OpOverload):
            return args, kwargs
        key = _key(op)
        if key in _LOWER:
            target = self.low_dtype
        elif key in _FP32:
            target = torch.float32
        elif key in _PROMOTE:
            floats = [t.dtype for t in pytree.tree_leaves((args, kwargs)) if _eligible(t)]
            if not floats:
                return args, kwargs
            target = functools.reduce(torch.promote_types, floats)
        elif key in _FP32_SET_OPT_DTYPE:
            return args, self._set_opt_dtype(op, args, kwargs)
        else:
            return args, kwargs
        cast = functools.partial(self._cast, dtype=target)
        return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))

    def _set_opt_dtype(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        # fp32_set_opt_dtype: if the input is low precision and no dtype was asked for, compute in fp32.
        names = [a.name for a in op._schema.arguments]
        pos = names.index("dtype")
        given = args[pos] if pos < len(args) else kwargs.get("dtype")
        if given is not None or not _eligible(args[0]) or args[0].dtype == torch.float32:
            return kwargs
        return {**kwargs, "dtype": torch.float32}


class ComputeDtypePolicy:
    """Parameters held in a lower compute dtype without autocast, as FSDP2's ``MixedPrecisionPolicy(
    param_dtype=...)`` runs a model: the unsharded parameters are ``param_dtype`` tensors, so the
    forward and backward compute in it. Buffers stay in their dtype (FSDP casts parameters only).

    The export was traced in fp32, so the model's own casts back to the compute dtype (``x.to(
    input_dtype)`` after an fp32 norm or rotary table, ``.to(query.dtype)`` after an fp32 softmax) are
    no-ops there and absent from the graph; FSDP casts every unit's floating inputs
    (``cast_forward_inputs``). Both are reproduced by one rule: an op whose floating inputs (of one or
    more dimensions) mix dtypes gets them in ``param_dtype``. Ops that write their inputs are left
    alone (a cast would redirect the write).

    A tensor is cast once per module, not once per op: FSDP casts a unit's input once at its
    pre-forward and every op of the unit reads that copy (Llama's rotary ``cos``/``sin``: one bf16 copy
    each per layer, shared by ``q`` and ``k``; a cast per op held twice the copies, all saved for
    backward: +2 KiB per layer on the gloo truth's models)."""

    def __init__(self, param_dtype: torch.dtype) -> None:
        self.param_dtype = param_dtype
        self.low_dtype = param_dtype   # the runner's test for "dtypes differ from the fp32 trace"
        self._casts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def clear_cache(self) -> None:
        """No weight cache (the parameters already are ``param_dtype`` tensors); the per-module casts go."""
        self._casts.clear()

    def apply(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable:
            return args, kwargs
        dtypes = {t.dtype for t in pytree.tree_leaves((args, kwargs)) if _eligible(t) and t.dim() > 0}
        if len(dtypes) < 2:
            return args, kwargs
        module = _current_module()

        def cast(t: torch.Tensor) -> torch.Tensor:
            if not (_eligible(t) and t.dim() > 0) or t.dtype == self.param_dtype:
                return t
            key = (id(t), module)
            hit = self._casts.get(key)
            if hit is None or hit[0] is not t:
                hit = self._casts[key] = (t, t.to(self.param_dtype))
            return hit[1]

        return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))


def _current_module() -> str:
    """The innermost module of the export node being run (``fx_traceback.set_current_meta``)."""
    stack = (fx_traceback.get_current_meta() or {}).get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _flash_ok(q: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    # sdp_utils.cpp can_use_flash_attention: fp16/bf16, no attn_mask, head_dim <= 256 and a
    # multiple of 8 (NB: simplified; the real check also looks at the sm version and strides). Fewer
    # key/value heads than query heads (enable_gqa: transformers' eager GQA call) are allowed: flash's
    # check_batch_size_and_num_heads_dense<true> (torch's SDPA doc: GQA runs on flash and math on CUDA)
    head_dim = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and attn_mask is None
        and isinstance(head_dim, int)
        and head_dim <= 256
        and head_dim % 8 == 0
    )


def _efficient_ok(q: torch.Tensor, enable_gqa: bool) -> bool:
    # can_use_mem_efficient_attention: fp32/fp16/bf16, head_dim a multiple of 8 (4 for fp32).
    head_dim = q.shape[-1]
    return (
        q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and not enable_gqa
        and isinstance(head_dim, int)
        and head_dim % (4 if q.dtype == torch.float32 else 8) == 0
    )


def gpu_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as a CUDA device would dispatch it (flash > efficient > math).

    Called with arguments already cast by :class:`CastPolicy` (SDPA is on autocast's low-precision
    list), so the kernel sees the dtypes it would see on the GPU.
    """
    if query.dim() != 4:
        return aten.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if _flash_ok(query, attn_mask):
        out = aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    if _efficient_ok(query, enable_gqa):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # sdp_utils converts boolean masks to additive float masks before the kernel.
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf")
            )
        # should_compute_logsumexp: the logsumexp is only kept when a backward will need it.
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        out = aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, need_lse, dropout_p, is_causal, scale=scale
        )
        return out[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]
