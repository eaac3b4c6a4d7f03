"""Matmul-family cost formulas: hand-derived numbers, symbolic sizes, equivalences, FlopCounterMode."""
import sympy
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from boomfx.passes.costs.registry import Cost, OpCall, price_call
from boomfx.passes.opcall import opcall_from_node
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten
F32 = 4
s0, s1, s2 = sympy.symbols("s0 s1 s2", positive=True, integer=True)

MATMUL_PACKETS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.linear, aten.matmul}


def spec(*shape, dtype=torch.float32):
    shape = tuple(sympy.sympify(s) for s in shape)
    return TensorSpec(shape, contiguous_strides(shape), dtype)


def price(op, *args, outputs=(), context=None, **kwargs) -> Cost:
    priced = price_call(OpCall.build(op, args, kwargs, outputs, context))
    assert priced.modelled, priced.reason
    return priced.cost


def family_flops(graph, packets) -> int:
    total = 0
    for node in graph.nodes:
        call = opcall_from_node(node)
        if call is not None and call.op.overloadpacket in packets:
            total += int(price_call(call).cost.flops)
    return total


def test_mm_exact():
    cost = price(aten.mm.default, spec(4, 16), spec(16, 8), outputs=(spec(4, 8),))
    assert cost.flops == 1024  # 2*M*N*K = 2*4*8*16
    assert cost.bytes_read == (4 * 16 + 16 * 8) * F32  # A + B = (64 + 128)*4 = 768
    assert cost.bytes_written == 4 * 8 * F32  # C = 128


def test_mm_symbolic():
    cost = price(aten.mm.default, spec(s0, s1), spec(s1, s2), outputs=(spec(s0, s2),))
    assert sympy.simplify(cost.flops - 2 * s0 * s1 * s2) == 0  # 2*M*K*N
    assert sympy.simplify(cost.bytes_read - 4 * (s0 * s1 + s1 * s2)) == 0
    assert cost.subs({s0: 4, s1: 16, s2: 8}).evaluate() == (1024, 768, 128)


def test_bmm_and_baddbmm():
    out = spec(3, 4, 8)
    bmm = price(aten.bmm.default, spec(3, 4, 16), spec(3, 16, 8), outputs=(out,))
    assert bmm.flops == 3072  # 2*B*M*N*K = 2*3*4*8*16
    badd = price(aten.baddbmm.default, spec(3, 4, 8), spec(3, 4, 16), spec(3, 16, 8), outputs=(out,))
    assert badd.flops == 3072 + 96  # + B*M*N = 3*4*8 for adding self


def test_addmm_equals_mm_plus_add_flops():
    a, b, bias, out = spec(4, 16), spec(16, 8), spec(8), spec(4, 8)
    addmm = price(aten.addmm.default, bias, a, b, outputs=(out,))
    mm = price(aten.mm.default, a, b, outputs=(out,))
    add = price(aten.add.Tensor, out, bias, outputs=(out,))
    assert addmm.flops == mm.flops + add.flops == 1024 + 32  # 2*4*8*16 + 4*8
    # fused: bias read once at its own size (8*4 B), no intermediate round trip
    assert addmm.bytes_read == mm.bytes_read + 8 * F32
    assert addmm.bytes_written == mm.bytes_written


def test_linear_with_and_without_bias():
    x, w, out = spec(2, 5, 16), spec(8, 16), spec(2, 5, 8)
    no_bias = price(aten.linear.default, x, w, outputs=(out,))
    assert no_bias.flops == 2560  # 2*out.numel*K = 2*(2*5*8)*16
    with_bias = price(aten.linear.default, x, w, spec(8), outputs=(out,))
    assert with_bias.flops == 2560 + 80  # + out.numel = 2*5*8
    assert with_bias.bytes_read == (160 + 128 + 8) * F32  # x + w + bias


def test_matmul_broadcast_reads_operand_once():
    # [B, M, K] @ [K, N]: the weight is read once, not B times
    cost = price(aten.matmul.default, spec(3, 4, 16), spec(16, 8), outputs=(spec(3, 4, 8),))
    assert cost.flops == 3072  # 2*3*4*8*16
    assert cost.bytes_read == (3 * 4 * 16 + 16 * 8) * F32


def test_mv_addmv_dot():
    assert price(aten.mv.default, spec(4, 16), spec(16), outputs=(spec(4),)).flops == 128  # 2*M*K = 2*4*16
    assert price(aten.addmv.default, spec(4), spec(4, 16), spec(16), outputs=(spec(4),)).flops == 132  # + 4
    assert price(aten.dot.default, spec(16), spec(16), outputs=(spec(),)).flops == 32  # 2*K


def test_addmm_activation_adds_epilogue():
    args = (spec(8), spec(4, 16), spec(16, 8))
    relu = price(aten._addmm_activation.default, *args, outputs=(spec(4, 8),))
    gelu = price(aten._addmm_activation.default, *args, outputs=(spec(4, 8),), use_gelu=True)
    assert relu.flops == 1024 + 32 + 32  # mm + bias add + relu (1/elem)
    assert gelu.flops == 1024 + 32 + 9 * 32  # tanh-GELU: 9/elem


def test_einsum_matches_bmm_and_outer():
    a, b = spec(3, 4, 16), spec(3, 16, 8)
    ein = price(aten.einsum.default, "bik,bkj->bij", [a, b], outputs=(spec(3, 4, 8),))
    assert ein.flops == 3072  # same as bmm: 2*3*4*8*16
    outer = price(aten.einsum.default, "i,j->ij", [spec(4), spec(8)], outputs=(spec(4, 8),))
    assert outer.flops == 32  # multiplies only: 4*8
    ell = price(aten.einsum.default, "...ik,...kj->...ij", [a, b], outputs=(spec(3, 4, 8),))
    assert ell.flops == 3072


def test_einsum_three_operands_left_to_right():
    # (ij,jk) -> ik: 2*2*3*4 = 48; (ik,kl) -> il: 2*2*4*5 = 80
    cost = price(aten.einsum.default, "ij,jk,kl->il", [spec(2, 3), spec(3, 4), spec(4, 5)],
                 outputs=(spec(2, 5),))
    assert cost.flops == 128


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_mlp_forward_agrees_with_flop_counter():
    model, x = _mlp(), torch.randn(4, 16)
    with FlopCounterMode(display=False) as fc:
        model(x)
    assert fc.get_total_flops() == 6144  # 2*4*16*32 + 2*4*32*8 = 4096 + 2048
    ep = torch.export.export(model, (x,))
    # we also count the bias adds (out.numel per linear): 4*32 + 4*8 = 160
    assert family_flops(ep.graph, MATMUL_PACKETS) == fc.get_total_flops() + 160


def test_mlp_training_step_agrees_with_flop_counter():
    model, x = _mlp(), torch.randn(4, 16)

    def step(inp):
        loss = model(inp).sum()
        loss.backward()
        return loss

    with FlopCounterMode(display=False) as fc:
        step(x)
    # fwd 6144; bwd: grad_w1 2*32*16*4, grad_x2 2*4*32*8, grad_w2 2*8*32*4 = 4096 + 2048 + 2048
    assert fc.get_total_flops() == 6144 + 8192
    graph = make_fx(step)(x).graph
    assert family_flops(graph, MATMUL_PACKETS) == fc.get_total_flops() + 160  # + bias adds of addmm


def test_bilinear_and_its_trilinear_kernel_by_hand():
    """nn.Bilinear, y[n, o] = x1[n] W[o] x2[n] + b[o]: 2 N O I1 I2 for the contraction with W, 2 N O I2 for the
    one with x2, + N O for the bias; its kernel, _trilinear, as 2 FLOPs per point of its product space."""
    x1, x2, w, b, out = spec(4, 16), spec(4, 12), spec(8, 16, 12), spec(8), spec(4, 8)
    bilinear = price_call(OpCall.build(torch.ops.aten.bilinear.default, (x1, x2, w, b), {}, (out,))).cost
    assert bilinear.flops == 2 * 4 * 8 * 16 * 12 + 2 * 4 * 8 * 12 + 32
    # _trilinear as ATen calls it for bilinear: i1 [4, 16] -> [4, 1, 16, 1], W [8, 16, 12] -> [1, 8, 16, 12],
    # i2 [4, 12] -> [4, 1, 1, 12], summed over dims 2 and 3: out [4, 8] x 16 x 12 points
    tri = price_call(OpCall.build(torch.ops.aten._trilinear.default,
                                  (x1, w, x2, [1, 3], [0], [1, 2], [2, 3]), {}, (out,))).cost
    assert tri.flops == 2 * 32 * 16 * 12
