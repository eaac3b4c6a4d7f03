"""Convolution cost formulas: hand-derived numbers, backward masks, FlopCounterMode on a small CNN."""
import sympy
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode, conv_backward_flop

from boomfx.passes.costs.registry import Cost, OpCall, price_call
from boomfx.passes.opcall import opcall_from_node
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten
F32 = 4
n, h = sympy.symbols("n h", positive=True, integer=True)

CONV_PACKETS = {aten.convolution, aten.conv2d, aten.convolution_backward}


def spec(*shape, dtype=torch.float32):
    shape = tuple(sympy.sympify(s) for s in shape)
    return TensorSpec(shape, contiguous_strides(shape), dtype)


def price(op, *args, outputs=(), **kwargs) -> Cost:
    priced = price_call(OpCall.build(op, args, kwargs, outputs))
    assert priced.modelled, priced.reason
    return priced.cost


def conv_args(x, w, bias=None, stride=(1, 1), padding=(0, 0), transposed=False, groups=1):
    return (x, w, bias, list(stride), list(padding), [1, 1], transposed, [0, 0], groups)


def test_conv2d_forward_exact():
    x, w, out = spec(1, 3, 8, 8), spec(4, 3, 3, 3), spec(1, 4, 6, 6)
    cost = price(aten.convolution.default, *conv_args(x, w), outputs=(out,))
    assert cost.flops == 7776  # 2*N*prod(out spatial)*prod(w) = 2*1*36*(4*3*3*3)
    assert cost.bytes_read == (192 + 108) * F32  # x 1*3*8*8 + w 4*3*3*3
    assert cost.bytes_written == 144 * F32  # out 1*4*6*6


def test_conv2d_bias_adds_output_elements():
    x, w, out = spec(1, 3, 8, 8), spec(4, 3, 3, 3), spec(1, 4, 6, 6)
    cost = price(aten.convolution.default, *conv_args(x, w, spec(4)), outputs=(out,))
    assert cost.flops == 7776 + 144  # + out.numel
    assert cost.bytes_read == (192 + 108 + 4) * F32


def test_conv2d_symbolic_batch_and_size():
    x, w, out = spec(n, 3, h, h), spec(4, 3, 3, 3), spec(n, 4, h - 2, h - 2)
    cost = price(aten.convolution.default, *conv_args(x, w), outputs=(out,))
    assert sympy.expand(cost.flops - 2 * n * (h - 2) ** 2 * 108) == 0  # 2*N*(H-2)^2*(4*3*3*3)
    assert cost.subs({n: 1, h: 8}).evaluate()[0] == 7776


def test_grouped_and_depthwise_conv():
    # depthwise: w [C, 1, 3, 3]: 2*N*prod(out)*prod(w) = 2*2*36*(8*9)
    x, w, out = spec(2, 8, 8, 8), spec(8, 1, 3, 3), spec(2, 8, 6, 6)
    cost = price(aten.convolution.default, *conv_args(x, w, groups=8), outputs=(out,))
    assert cost.flops == 10368


def test_conv_transpose_uses_input_spatial():
    # transposed weight [C_in, C_out, k, k]; 2*N*prod(in spatial)*prod(w) = 2*1*(4*4)*(8*3*3*3)
    x, w, out = spec(1, 8, 4, 4), spec(8, 3, 3, 3), spec(1, 3, 6, 6)
    cost = price(aten.convolution.default, *conv_args(x, w, transposed=True), outputs=(out,))
    assert cost.flops == 6912
    same = price(aten.conv_transpose2d.input, x, w, outputs=(out,))
    assert same.flops == 6912


def test_conv1d_and_conv3d_default_ir():
    assert price(aten.conv1d.default, spec(2, 4, 10), spec(6, 4, 3), outputs=(spec(2, 6, 8),)).flops == \
        2 * 2 * 8 * (6 * 4 * 3)  # = 2304
    assert price(aten.conv3d.default, spec(1, 2, 4, 4, 4), spec(3, 2, 3, 3, 3),
                 outputs=(spec(1, 3, 2, 2, 2),)).flops == 2 * 1 * 8 * (3 * 2 * 27)  # = 2592


def _backward_args(g, x, w, mask, transposed=False):
    return (g, x, w, [w.shape[0]], [1, 1], [0, 0], [1, 1], transposed, [0, 0], 1, mask)


def test_convolution_backward_by_mask():
    g, x, w = spec(1, 4, 6, 6), spec(1, 3, 8, 8), spec(4, 3, 3, 3)
    outs = (spec(1, 3, 8, 8), spec(4, 3, 3, 3), spec(4))
    gi = price(aten.convolution_backward.default, *_backward_args(g, x, w, [True, False, False]),
               outputs=(outs[0], None, None))
    gw = price(aten.convolution_backward.default, *_backward_args(g, x, w, [False, True, False]),
               outputs=(None, outs[1], None))
    gb = price(aten.convolution_backward.default, *_backward_args(g, x, w, [False, False, True]),
               outputs=(None, None, outs[2]))
    assert gi.flops == 7776  # conv_transpose(grad_out, w): 2*1*36*108, same as forward
    assert gw.flops == 7776  # conv(x^T, grad_out^T): 2*3*(3*3)*(4*1*6*6)
    assert gb.flops == 144  # sum of grad_out: 1*4*6*6
    assert gi.bytes_read == (144 + 108) * F32  # grad_out + weight
    assert gw.bytes_read == (144 + 192) * F32  # grad_out + input
    everything = price(aten.convolution_backward.default, *_backward_args(g, x, w, [True, True, True]),
                       outputs=outs)
    assert everything == gi + gw + gb


def test_convolution_backward_matches_flop_counter_formula():
    g, x, w = spec(2, 4, 3, 3), spec(2, 8, 8, 8), spec(4, 8, 3, 3)
    outs = (spec(2, 8, 8, 8), spec(4, 8, 3, 3), None)
    ours = price(aten.convolution_backward.default, *_backward_args(g, x, w, [True, True, False]),
                 outputs=outs)
    theirs = conv_backward_flop(
        (2, 4, 3, 3), (2, 8, 8, 8), (4, 8, 3, 3), None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1,
        [True, True, False], out_val=((2, 8, 8, 8), (4, 8, 3, 3), None))
    assert ours.flops == theirs


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, stride=2)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


def _family_flops(graph) -> int:
    total = 0
    for node in graph.nodes:
        call = opcall_from_node(node)
        if call is not None and call.op.overloadpacket in CONV_PACKETS:
            total += int(price_call(call).cost.flops)
    return total


def test_cnn_forward_and_backward_agree_with_flop_counter():
    torch.manual_seed(0)
    model, x = _CNN(), torch.randn(2, 3, 8, 8)

    def step(inp):
        loss = model(inp).sum()
        loss.backward()
        return loss

    with FlopCounterMode(display=False) as fc:
        model(x)
    # c1: 2*2*(8*8)*(8*3*3*3) = 55296; c2 out 3x3: 2*2*(3*3)*(4*8*3*3) = 10368
    assert fc.get_total_flops() == 55296 + 10368
    ep = torch.export.export(model, (x,))
    bias_fwd = 2 * 8 * 8 * 8 + 2 * 4 * 3 * 3  # out.numel of each conv: 1024 + 72
    assert _family_flops(ep.graph) == fc.get_total_flops() + bias_fwd

    with FlopCounterMode(display=False) as fc:
        step(x)
    graph = make_fx(step)(x).graph
    # backward also sums grad_out for each grad_bias: the same 1024 + 72 elements
    assert _family_flops(graph) == fc.get_total_flops() + 2 * bias_fwd
