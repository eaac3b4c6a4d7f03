"""Recurrent layers (``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu``) re-traced as the kernels eager PyTorch runs.

An export keeps a whole ``nn.LSTM``/``nn.GRU``/``nn.RNN`` stack as one node; its C++ kernel reads the batch as
an int (a symbolic batch would be fixed to the example's). Eager PyTorch runs, on a CPU:

- LSTM in fp32 or bf16 without projections: oneDNN's fused LSTM, one ``mkldnn_rnn_layer`` per layer and
  direction, forward and (under autograd, ``train=True`` with its workspace saved) backward
  (``aten/src/ATen/native/RNN.cpp``: ``use_mkldnn`` does not look at autograd, only fp16 does);
- every other recurrent layer (and an LSTM elsewhere): ATen's loop of per-step cell ops (``addmm``, the
  gates' ``sigmoid``/``tanh``, the cell update), which torch's Python decompositions write out on SymInts.

``run_recurrent`` picks the first for an LSTM on a CPU tensor (here, unlike torch's decomposition, also under
autograd, as eager does) and the decomposition otherwise. ``training/fake_kernels.py`` gives the oneDNN layer's
training workspace its real size, which the meta function leaves empty.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch._dispatch.python import enable_python_dispatcher

from boomfx.core.program import META_NATIVE_LOOP

aten = torch.ops.aten

RNN_OPS = {aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input}
ONEDNN_LSTM_MODE = 2        # ideep::rnn_kind::LSTM
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def run_recurrent(target: Any, args: Sequence[Any], kwargs: dict[str, Any], feeds_matmul: bool = False) -> Any:
    """The layer stack as eager runs it (module docstring); ``args`` as the export node's.

    A ``batch_first`` output that a ``linear``/``matmul`` reads (``feeds_matmul``) is returned contiguous:
    eager returns a transposed view, and the matmul folds it into one ``mm`` after copying it; on symbolic
    sizes the traced ``matmul`` cannot prove the fold and takes ``bmm`` with an out-of-place bias ``add``
    (a second logits-sized tensor at the peak). The copy here is the one eager's fold makes."""
    if target is aten.lstm.input and _onednn_lstm(args):
        outputs = _lstm_onednn(*args, **kwargs)
    else:
        graph = _traced_graph()
        before = len(graph.nodes) if graph is not None else 0
        with enable_python_dispatcher():
            outputs = target(*args, **kwargs)
        if graph is not None:      # ATen's C++ loop issues these per step, not Python (META_NATIVE_LOOP)
            for node in list(graph.nodes)[before:]:
                node.meta[META_NATIVE_LOOP] = True
    if args[8] and feeds_matmul:     # batch_first (the last argument of every ``.input`` overload)
        outputs = (outputs[0].contiguous(), *outputs[1:])
    return outputs


def _traced_graph() -> Any:
    """The graph make_fx is recording into (None outside a trace)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    mode = get_proxy_mode()
    return mode.tracer.graph if mode is not None else None


def output_feeds_matmul(node: Any) -> bool:
    """Whether a recurrent node's output sequence (``getitem 0``) is read by a ``linear``/``matmul``."""
    sequences = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    return any(getattr(v.target, "overloadpacket", None) in (aten.linear, aten.matmul)
               for u in sequences for v in u.users)


def _onednn_lstm(args: Sequence[Any]) -> bool:
    x, hx, params = args[0], args[1], args[2]
    tensors = [x, *hx, *params]
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and all(t.device.type == "cpu" and t.dtype in ONEDNN_DTYPES for t in tensors)
            and hx[0].size(2) == hx[1].size(2))       # no projections (proj_size)


def _lstm_onednn(x: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
                 num_layers: int, dropout: float, train: bool, bidirectional: bool,
                 batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num_layers`` x directions ``mkldnn_rnn_layer`` calls on ``[T, B, I]``, the directions' outputs
    concatenated, dropout between layers in training, as ATen's ``mkldnn_rnn`` does."""
    directions = 2 if bidirectional else 1
    per_layer = 4 if has_biases else 2
    hidden = hx[0].size(2)
    layer_input = x.transpose(0, 1) if batch_first else x
    h_n, c_n = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            weights = list(params[index * per_layer:(index + 1) * per_layer])
            if not has_biases:
                weights += [torch.zeros_like(weights[0][:, 0]), torch.zeros_like(weights[1][:, 0])]
            y, hy, cy, _ = aten.mkldnn_rnn_layer(
                layer_input.contiguous(), *weights, hx[0][index:index + 1].contiguous(),
                hx[1][index:index + 1].contiguous(), direction == 1, [], ONEDNN_LSTM_MODE, hidden, 1,
                has_biases, False, False, train)
            outputs.append(y)
            h_n.append(hy)
            c_n.append(cy)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout > 0 and train and layer < num_layers - 1:
            layer_input = torch.nn.functional.dropout(layer_input, dropout, True)
    out = layer_input.transpose(0, 1) if batch_first else layer_input
    return out, torch.cat(h_n, 0), torch.cat(c_n, 0)
