"""Cost rules for scaled dot-product attention (SDPA) forward and backward, per backend variant.

Shapes: ``q [B, Hq, L, E]``, ``k [B, Hkv, S, E]``, ``v [B, Hkv, S, Ev]`` (GQA: ``Hkv`` divides
``Hq``; KV heads are broadcast, so FLOPs use ``Hq``). ``BH = B * Hq``.

FLOPs (the matmuls only, as ``torch.utils.flop_counter.sdpa_flop_count``):

1. forward ``scores = q @ k^T``: ``2 * BH * L * S * E``; ``out = P @ v``: ``2 * BH * L * S * Ev``;
2. backward recomputes ``q @ k^T`` (``2*BH*L*S*E``), then ``dP = dO @ v^T`` (``2*BH*L*S*Ev``),
   ``dV = P^T @ dO`` (``2*BH*S*L*Ev``), ``dQ = dS @ k`` (``2*BH*L*S*E``), ``dK = dS^T @ q``
   (``2*BH*S*L*E``): ``2 * BH * L * S * (3E + 2Ev)`` in total;
3. causal (``is_causal``): fused kernels skip the masked upper triangle, so every term scales with
   the (query, key) pairs attended instead of ``L * S`` (``attended_pairs``). PyTorch aligns the
   causal mask top-left (``tril(ones(L, S))``): query ``i`` sees keys ``0..i``, i.e. ``min(i+1, S)``;
   summed: ``m(m+1)/2 + (L-m)*S`` with ``m = min(L, S)``, e.g. ``L(L+1)/2`` when ``L == S``.
   A left window (``window_size_left = W`` of ``_flash_attention_forward/backward``) caps each query at
   ``W + 1`` keys: with ``w = min(W+1, L)``, ``w(w+1)/2 + (L-w)*w`` pairs (``L == S``, causal).
   NB: intentional difference: ``FlopCounterMode`` counts causal attention as full. The "math"
   variant computes the full score matrix and then masks it, so it is *not* reduced. The kernel-time
   model (``kernels_db/attention_model.py``) prices whole score tiles; FLOPs here are the exact work.
4. NB: the softmax (about 5 FLOPs per score element: max, sub, exp, sum, div) and the scale are
   not counted, as in ``flop_counter``; they matter on the special-function unit, not the FLOP
   rate, and keep "decomposed math FLOPs == fused FLOPs" true for the matmul work.

Bytes, by variant (``context["sdpa_backend"]`` for the backend-agnostic ``scaled_dot_product_attention``,
the op itself for the backend-specific ops):

- flash / efficient / cudnn (fused): read q, k, v (and an explicit mask/bias at its own size),
  write ``out`` and the float32 ``logsumexp`` ``[B, Hq, L]``; the score matrix never leaves chip.
- math: the ``BH * L * S`` score matrix (``q`` dtype) is materialised:
  (a) ``q @ k^T`` writes it; (b) a mask, if any (explicit, or the ``L*S`` bool causal mask), is
  applied: read scores + mask, write scores; (c) softmax reads and writes it; (d) dropout
  (``dropout_p > 0``) reads it and writes it plus a bool mask; (e) ``P @ v`` reads it.
  With GQA the math path first expands ``k``/``v`` to ``Hq`` heads (write + read the copies).
- backward (fused): read dO, q, k, v, out, logsumexp (+ bias); write dq, dk, dv (+ dbias).

Example::

    >>> # non-causal: 2*BH*L*S*E + 2*BH*L*S*Ev = 2*8*16*16*32*2 = 262144 FLOPs for B=2, H=4, L=S=16, E=Ev=32
    >>> # causal: 16*17/2 = 136 of the 256 pairs: 262144 * 136/256 = 139264

Known limitations:
- NB: fused kernels re-read k/v once per query tile; that traffic is assumed to hit L2.
- NB: packed variable-length (nested) inputs are priced at the worst case ``max_q``/``max_k``
  per sequence, like ``flop_counter``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch

from boomfx.passes.costs.pointwise import bytes_of, first_output, read_all, unique_bytes, written_all
from boomfx.passes.costs.registry import Cost, OpCall, register_cost
from boomfx.passes.specs import SymExpr, TensorSpec

aten = torch.ops.aten

FUSED_BACKENDS = frozenset({"flash", "efficient", "cudnn"})
DEFAULT_BACKEND = "flash"
LSE_ITEMSIZE = 4  # logsumexp is float32 in every fused kernel


@dataclass(frozen=True)
class AttnDims:
    """Problem sizes of one attention call; ``bh`` = batch * query heads."""

    bh: SymExpr
    bh_kv: SymExpr
    L: SymExpr
    S: SymExpr
    E: SymExpr
    Ev: SymExpr


def _prod(values: Any) -> SymExpr:
    return sympy.Mul(*values) if len(values) else sympy.Integer(1)


def dims_bhle(q: TensorSpec, k: TensorSpec, v: TensorSpec) -> AttnDims:
    """Layout ``[..., H, L, E]`` (SDPA ops): every leading dim is batch x heads."""
    return AttnDims(_prod(q.shape[:-2]), _prod(k.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1],
                    v.shape[-1])


def dims_blhe(call: OpCall, q: TensorSpec, k: TensorSpec, v: TensorSpec, max_q: str, max_k: str) -> AttnDims:
    """Layout ``[B, L, H, E]`` (``_flash/_efficient_attention_*``); packed ``[T, H, E]`` uses max lengths."""
    if q.ndim == 4:
        return AttnDims(q.shape[0] * q.shape[2], k.shape[0] * k.shape[2], q.shape[1], k.shape[1],
                        q.shape[-1], v.shape[-1])
    cum = call.arg("cum_seq_q", call.arg("cu_seqlens_q"))
    batch = cum.shape[0] - 1 if isinstance(cum, TensorSpec) else sympy.Integer(1)
    L = call.arg(max_q) if call.arg(max_q) is not None else q.shape[0]
    S = call.arg(max_k) if call.arg(max_k) is not None else k.shape[0]
    return AttnDims(batch * q.shape[-2], batch * k.shape[-2], L, S, q.shape[-1], v.shape[-1])


def attended_pairs(d: AttnDims, causal: bool, window_left: Any = None) -> SymExpr:
    """(query, key) pairs per head attended (step 3): ``L*S``; causal top-left ``m(m+1)/2 + (L-m)*S``;
    with a left window ``w(w+1)/2 + (L-w)*w`` (``w = min(W+1, L)``, assumes ``L == S``)."""
    if not causal:
        return d.L * d.S
    if window_left is not None and not (isinstance(window_left, int) and window_left < 0):   # -1: no window
        w = sympy.Min(sympy.sympify(window_left) + 1, d.L)
        return w * (w + 1) / 2 + (d.L - w) * w
    m = sympy.Min(d.L, d.S)
    return m * (m + 1) / 2 + (d.L - m) * d.S


def forward_flops(d: AttnDims, causal_skip: bool, window_left: Any = None) -> SymExpr:
    """``2*BH*pairs*E + 2*BH*pairs*Ev`` (``pairs = L*S`` unless masked tiles are skipped, step 3)."""
    pairs = attended_pairs(d, causal_skip, window_left)
    return 2 * d.bh * pairs * d.E + 2 * d.bh * pairs * d.Ev


def backward_flops(d: AttnDims, causal_skip: bool, window_left: Any = None) -> SymExpr:
    """``2*BH*pairs*(3E + 2Ev)`` (step 2), ``pairs`` as in the forward."""
    return 2 * d.bh * attended_pairs(d, causal_skip, window_left) * (3 * d.E + 2 * d.Ev)


def _backend(call: OpCall) -> str:
    backend = call.context.get("sdpa_backend", DEFAULT_BACKEND)
    if backend not in FUSED_BACKENDS and backend != "math":
        raise ValueError(f"unknown sdpa_backend {backend!r}; expected flash, efficient, cudnn or math")
    return backend


def math_forward_bytes(call: OpCall, d: AttnDims, q: TensorSpec, k: TensorSpec, v: TensorSpec,
                       out: TensorSpec) -> tuple[SymExpr, SymExpr]:
    """(read, written) of the unfused math path, steps (a)-(e) of the module docstring."""
    score = d.bh * d.L * d.S * q.itemsize
    read = bytes_of([q, k, v]) + score  # (a) q, k; (e) v and the probabilities
    written = score + unique_bytes(out)  # (a) scores; (e) out
    if d.bh_kv != d.bh:  # GQA: expanded k, v copies written, then read instead of k, v
        expanded = d.bh * d.S * (d.E * k.itemsize + d.Ev * v.itemsize)
        read, written = read + expanded, written + expanded
    mask = call.arg("attn_mask")
    if isinstance(mask, TensorSpec) or call.arg("is_causal"):
        mask_bytes = unique_bytes(mask) if isinstance(mask, TensorSpec) else d.L * d.S
        read, written = read + score + mask_bytes, written + score  # (b)
    read, written = read + score, written + score  # (c) softmax
    if (call.arg("dropout_p") or 0) > 0:
        read, written = read + score, written + score + d.bh * d.L * d.S  # (d) + bool mask
    return read, written


@register_cost(aten.scaled_dot_product_attention)
def sdpa_cost(call: OpCall) -> Cost:
    """Backend-agnostic SDPA (default export IR); the backend comes from ``context["sdpa_backend"]``."""
    q, k, v, out = call.arg("query"), call.arg("key"), call.arg("value"), first_output(call)
    d = dims_bhle(q, k, v)
    backend = _backend(call)
    causal = bool(call.arg("is_causal"))
    if backend == "math":
        read, written = math_forward_bytes(call, d, q, k, v, out)
        return Cost(forward_flops(d, False), read, written)
    read = bytes_of([q, k, v, call.arg("attn_mask")])
    written = unique_bytes(out) + d.bh * d.L * LSE_ITEMSIZE
    return Cost(forward_flops(d, causal), read, written)


@register_cost(aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
               aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu)
def fused_sdpa_cost(call: OpCall) -> Cost:
    """Backend-specific fused forward: matmul FLOPs (halved if causal); q, k, v (+bias) read, outputs written."""
    d = dims_bhle(call.arg("query"), call.arg("key"), call.arg("value"))
    return Cost(forward_flops(d, bool(call.arg("is_causal"))), read_all(call), written_all(call))


@register_cost(aten._scaled_dot_product_flash_attention_backward,
               aten._scaled_dot_product_efficient_attention_backward,
               aten._scaled_dot_product_cudnn_attention_backward,
               aten._scaled_dot_product_flash_attention_for_cpu_backward)
def fused_sdpa_backward_cost(call: OpCall) -> Cost:
    """Fused backward: 5 matmuls (step 2, halved if causal); dO, q, k, v, out, lse read; grads written."""
    d = dims_bhle(call.arg("query"), call.arg("key"), call.arg("value"))
    return Cost(backward_flops(d, bool(call.arg("is_causal"))), read_all(call), written_all(call))


def _low_level_dims(call: OpCall) -> AttnDims:
    if "cum_seq_q" in call.args:
        return dims_blhe(call, call.arg("query"), call.arg("key"), call.arg("value"), "max_q", "max_k")
    return dims_blhe(call, call.arg("query"), call.arg("key"), call.arg("value"), "max_seqlen_q",
                     "max_seqlen_k")


def _low_level_causal(call: OpCall) -> bool:
    if "is_causal" in call.args:
        return bool(call.arg("is_causal"))
    return (call.arg("custom_mask_type") or 0) != 0  # efficient: 1/2 = causal from top-left/bottom-right


@register_cost(aten._flash_attention_forward, aten._efficient_attention_forward)
def low_level_attention_cost(call: OpCall) -> Cost:
    """The kernels under the SDPA ops, in ``[B, L, H, E]`` layout; same formulas (flash: left window)."""
    return Cost(forward_flops(_low_level_dims(call), _low_level_causal(call), call.arg("window_size_left")),
                read_all(call), written_all(call))


@register_cost(aten._flash_attention_backward, aten._efficient_attention_backward)
def low_level_attention_backward_cost(call: OpCall) -> Cost:
    """Backward of the ``[B, L, H, E]`` kernels; same 5-matmul formula."""
    return Cost(backward_flops(_low_level_dims(call), _low_level_causal(call), call.arg("window_size_left")),
                read_all(call), written_all(call))

