"""Cost rules for oneDNN's fused LSTM layer (``mkldnn_rnn_layer`` and its backward), the kernel eager PyTorch
runs for an fp32/bf16 ``nn.LSTM`` layer on a CPU (torch's ``lstm`` decomposition picks it as ATen does).

The other recurrent layers (GRU, RNN, LSTM under autograd in a traced step) reach the pricer as the cell ops
they run per step (``addmm``, ``sigmoid``, ``tanh``, ...), priced by their own rules.

Derivation, one direction of one layer, ``T`` steps of a batch ``B``, input width ``I``, hidden ``H``, LSTM's
four gates (``G = 4H``):

1. the input projection of every step, ``[T*B, I] @ [I, G]``: ``2*T*B*I*G`` FLOPs;
2. the recurrent projection, one ``[B, H] @ [H, G]`` per step: ``2*T*B*H*G`` FLOPs;
3. the gates' nonlinearities and the cell update, about 10 FLOPs per hidden unit per step (``10*T*B*H``);
4. bytes: the input, both weights and biases, ``h0``/``c0`` read; the output sequence, ``h_n``, ``c_n`` and the
   workspace written (the op's outputs);
5. the backward computes the gradients of the input and of both weights: twice the forward's products
   (``4*T*B*(I + H)*G``), and reads the forward's saved tensors.

Example::

    >>> # T=64, B=8, I=H=256: 2*64*8*(256 + 256)*1024 + 10*64*8*256 = 538,181,632 FLOPs
"""
from __future__ import annotations

import sympy
import torch

from boomfx.passes.costs.pointwise import read_all, written_all
from boomfx.passes.costs.registry import Cost, OpCall, register_cost

aten = torch.ops.aten
CELL_FLOPS_PER_UNIT = 10
LSTM_GATES = 4


def lstm_layer_dims(call: OpCall) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
    """(steps T, batch B, input width I, hidden H) of a ``mkldnn_rnn_layer`` call (its input is ``[T, B, I]``
    unless ``batch_first``)."""
    x = call.arg("input")
    hidden = sympy.sympify(call.arg("hidden_size"))
    steps, batch = (x.shape[1], x.shape[0]) if call.arg("batch_first") else (x.shape[0], x.shape[1])
    return steps, batch, x.shape[-1], hidden


def lstm_layer_flops(call: OpCall) -> sympy.Expr:
    """Steps 1-3 of the module docstring."""
    steps, batch, width, hidden = lstm_layer_dims(call)
    gates = LSTM_GATES * hidden
    return 2 * steps * batch * (width + hidden) * gates + CELL_FLOPS_PER_UNIT * steps * batch * hidden


@register_cost(aten.mkldnn_rnn_layer)
def mkldnn_rnn_layer_cost(call: OpCall) -> Cost:
    """oneDNN's LSTM layer forward: steps 1-4."""
    return Cost(lstm_layer_flops(call), read_all(call), written_all(call))


@register_cost(aten.mkldnn_rnn_layer_backward)
def mkldnn_rnn_layer_backward_cost(call: OpCall) -> Cost:
    """Its backward (step 5): the input's and both weights' gradients, reading the saved forward."""
    steps, batch, width, hidden = lstm_layer_dims(call)
    products = 4 * steps * batch * (width + hidden) * LSTM_GATES * hidden
    return Cost(products + CELL_FLOPS_PER_UNIT * steps * batch * hidden, read_all(call), written_all(call))
