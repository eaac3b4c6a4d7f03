"""Fake-tensor kernels that torch's own meta functions get wrong while boomfx traces a step.

Why: boomfx traces training steps under ``make_fx`` on fake tensors with symbolic sizes. A few of torch's
meta functions fail there although the op is well defined on a GPU; the step then cannot be traced at
all. Inside :func:`fake_kernel_fixes` the fake mode computes those ops' outputs with the functions below
(registered as fake-tensor implementations for the duration only), while make_fx still records each op
exactly as called, as one node.

Fixed ops:

- ``aten._scaled_dot_product_efficient_attention_backward`` with a bias that needs a gradient (T5's
  relative position bias, passed to SDPA as a float ``attn_mask``; the memory-efficient kernel is what
  CUDA picks for a float mask). Torch's meta function slices its padded bias gradient with a symbolic
  length (``grad_bias[..., :lastDim]``), which trips an internal assert of the Python argument parser
  (torch 2.13). Here the other three gradients come from torch's meta function (bias gradient not
  requested) and the bias gradient is built the same way, with ``narrow`` instead of indexing: a buffer
  whose last dimension is padded to a multiple of 16 elements, viewed at the bias's length, as the
  kernel allocates it (``aten/src/ATen/native/transformers/cuda/attention_backward.cu``).

- ``aten.histc`` of an integer tensor (transformers' MoE routing counts tokens per expert with it; an
  export on a CUDA or meta device records the integer form, which CUDA implements). Torch's meta function
  (``meta_histc``) refuses integer input on the CPU device boomfx traces on, as the CPU kernel does. Its
  output is ``[bins]`` of the input's dtype.

- ``aten.mkldnn_rnn_layer`` in training (``train=True`` under autograd): oneDNN's LSTM saves a workspace for its backward
  (about 16 x steps x batch x hidden x 4 bytes in fp32, with oneDNN's own padding), which torch's meta
  function returns empty. Its size is read off a real call at the trace's example sizes (zero tensors, once
  per shape; at most 32 steps x 8 rows) and scaled with steps x batch (measured: doubling the steps gave
  1.98x, doubling the batch 2.00x).

- ``aten.upsample_{nearest,linear,bilinear,bicubic,trilinear}{1,2,3}d`` and their backwards
  (``F.interpolate``, ``nn.Upsample``): their meta functions read the input's sizes as ints, fixing a symbolic
  batch to the example's (``--train`` refused every model with an interpolation). The output is the input's
  leading dimensions and the requested spatial size (the backward: ``input_size``), in the input's memory
  format, as the kernels allocate it.

Known limitations: only the ops above; any other meta failure still raises. The registration is
process-wide while the context is open (torch keeps fake implementations in one table).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses import fake_impls

aten = torch.ops.aten

_BIAS_ALIGN_ELEMENTS = 16   # mem-efficient attention pads the bias gradient's last dim to 16 elements


def named_args(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An op call's arguments by schema name (positional ones named, keyword ones as given)."""
    values = dict(zip((a.name for a in op._schema.arguments), args))
    values.update(kwargs)
    return values


def _efficient_attention_backward(fake_mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    values = named_args(op, args, kwargs)
    mask = list(values["grad_input_mask"])
    bias = values["attn_bias"]
    if bias is None or not mask[3]:
        return NotImplemented      # torch's meta function handles it
    values["grad_input_mask"] = [*mask[:3], False]
    with fake_mode:   # ops on fake tensors again, inside the fake mode's dispatch (not recorded)
        grad_q, grad_k, grad_v, _ = op(**values)
        last = bias.size(-1)
        aligned = (last + _BIAS_ALIGN_ELEMENTS - 1) // _BIAS_ALIGN_ELEMENTS * _BIAS_ALIGN_ELEMENTS
        padded = torch.empty([*bias.shape[:-1], aligned], dtype=bias.dtype, device=bias.device)
    return grad_q, grad_k, grad_v, padded.narrow(-1, 0, last)


def _histc(fake_mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    values = named_args(op, args, kwargs)
    bins = values.get("bins", 100)
    with fake_mode:
        return torch.empty([bins], dtype=values["self"].dtype, device=values["self"].device)


WORKSPACE_PROBE_STEPS = 32
WORKSPACE_PROBE_BATCH = 8


def _onednn_lstm_layer(fake_mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    values = named_args(op, args, kwargs)
    if not values["train"] or not torch.is_grad_enabled():
        return NotImplemented      # no workspace (ATen keeps none without autograd): torch's meta function is right
    x, hidden = values["input"], int(values["hidden_size"])
    steps, batch = (x.size(1), x.size(0)) if values["batch_first"] else (x.size(0), x.size(1))
    # measured at the example's sizes, at most WORKSPACE_PROBE_STEPS x WORKSPACE_PROBE_BATCH (a long sequence
    # of a large batch would allocate gigabytes for it; per step and row the workspace is flat past these)
    per_row = _workspace_bytes(min(_hint(steps), WORKSPACE_PROBE_STEPS), min(_hint(batch), WORKSPACE_PROBE_BATCH),
                               int(x.size(-1)), hidden, x.dtype)
    shape = (batch, steps, hidden) if values["batch_first"] else (steps, batch, hidden)
    with fake_mode:
        new = x.new_empty
        return (new(shape), new((1, batch, hidden)), new((1, batch, hidden)),
                new((per_row * steps * batch,), dtype=torch.uint8))


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


@functools.lru_cache(maxsize=None)
def _workspace_bytes(steps: int, batch: int, width: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes per (step, batch row) of oneDNN's LSTM training workspace, from one real call at these sizes."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), torch.enable_grad():  # real tensors, outside the fake mode and make_fx
        gates = 4 * hidden
        x = torch.zeros(steps, batch, width, dtype=dtype)
        weights = (torch.zeros(gates, width, dtype=dtype), torch.zeros(gates, hidden, dtype=dtype),
                   torch.zeros(gates, dtype=dtype), torch.zeros(gates, dtype=dtype))
        state = torch.zeros(1, batch, hidden, dtype=dtype)
        workspace = aten.mkldnn_rnn_layer(x, *weights, state, state, False, [], 2, hidden, 1, True, False, False,
                                          True)[3]
    return -(-workspace.numel() * workspace.element_size() // (steps * batch))


def _upsample(fake_mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    values = named_args(op, args, kwargs)
    if "grad_output" in values:       # the backward: a gradient of the input's size
        like, shape = values["grad_output"], list(values["input_size"])
    else:
        like = values["self"]
        shape = [*like.shape[:2], *values["output_size"]]
    channels_last = like.dim() == 4 and like.is_contiguous(memory_format=torch.channels_last) \
        and not like.is_contiguous()
    with fake_mode:
        return torch.empty(shape, dtype=like.dtype, device=like.device,
                           memory_format=torch.channels_last if channels_last else torch.contiguous_format)


_UPSAMPLES = [getattr(aten, f"upsample_{kind}{d}d{suffix}").default
              for kind, dims in (("nearest", (1, 2, 3)), ("linear", (1,)), ("bilinear", (2,)), ("bicubic", (2,)),
                                 ("trilinear", (3,)))
              for d in dims for suffix in ("", "_backward")]

_FIXES = {
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_backward,
    aten.histc.default: _histc,
    aten.mkldnn_rnn_layer.default: _onednn_lstm_layer,
    **{op: _upsample for op in _UPSAMPLES},
}


@contextlib.contextmanager
def fake_kernel_fixes() -> Iterator[None]:
    """Within: the ops of the module docstring use the fake implementations here."""
    added = [op for op in _FIXES if op not in fake_impls.op_implementations_dict]
    for op in added:
        fake_impls.op_implementations_dict[op] = _FIXES[op]
    try:
        yield
    finally:
        for op in added:
            fake_impls.op_implementations_dict.pop(op, None)
