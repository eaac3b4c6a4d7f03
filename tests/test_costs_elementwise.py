"""Pointwise, reduction, norm, indexing, view and optimizer cost formulas; coverage of a GPT graph."""
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from boomfx.passes.costs.registry import Cost, OpCall, price_call
from boomfx.passes.costs.views import VIEW_OPS, is_view_op
from boomfx.passes.opcall import opcall_from_node
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten
F32, I64 = 4, 8
s0 = sympy.Symbol("s0", positive=True, integer=True)


def spec(*shape, dtype=torch.float32, stride=None):
    shape = tuple(sympy.sympify(s) for s in shape)
    stride = tuple(sympy.sympify(s) for s in stride) if stride else contiguous_strides(shape)
    return TensorSpec(shape, stride, dtype)


def price(op, *args, outputs=(), **kwargs) -> Cost:
    priced = price_call(OpCall.build(op, args, kwargs, outputs))
    assert priced.modelled, priced.reason
    return priced.cost


# --- pointwise -------------------------------------------------------------------------------

def test_add_broadcast_reads_each_input_at_its_own_size():
    cost = price(aten.add.Tensor, spec(4, 8), spec(8), outputs=(spec(4, 8),))
    assert cost == Cost(32, (32 + 8) * F32, 32 * F32)  # 4*8 adds; 2 reads (bias once) + 1 write


def test_out_variant_writes_out_without_reading_it():
    # DDP's copy into its bucket: mul.Scalar_out(grad, 1/world, out=view); 32 multiplies, read grad, write the view
    cost = price(aten.mul.Scalar_out, spec(4, 8), 0.5, out=spec(4, 8), outputs=(spec(4, 8),))
    assert cost == Cost(32, 32 * F32, 32 * F32)


def test_expanded_input_counts_stride_zero_dims_once():
    expanded = spec(4, 8, stride=(0, 1))  # x.expand(4, 8) of an [8] tensor
    cost = price(aten.mul.Tensor, spec(4, 8), expanded, outputs=(spec(4, 8),))
    assert cost.bytes_read == (32 + 8) * F32


def test_scalar_args_are_free_and_alpha_costs_a_multiply():
    assert price(aten.mul.Tensor, spec(s0), 2.0, outputs=(spec(s0),)) == Cost(s0, 4 * s0, 4 * s0)
    assert price(aten.add.Tensor, spec(10), spec(10), outputs=(spec(10),), alpha=2).flops == 20  # 2*10


def test_inplace_variant_has_same_cost():
    x = spec(16)
    assert price(aten.add_.Tensor, x, x, outputs=(x,)) == price(aten.add.Tensor, x, x, outputs=(x,))


def test_activation_constants():
    x = spec(10)
    assert price(aten.relu.default, x, outputs=(x,)).flops == 10  # 1/elem
    assert price(aten.gelu.default, x, outputs=(x,)).flops == 50  # erf GELU: 5/elem
    assert price(aten.gelu.default, x, outputs=(x,), approximate="tanh").flops == 90  # 9/elem
    assert price(aten.silu.default, x, outputs=(x,)).flops == 50  # x*sigmoid: 5/elem
    assert price(aten.gelu_backward.default, x, x, outputs=(x,)).flops == 120  # 5 + 7
    assert price(aten.lerp.Scalar, x, x, 0.5, outputs=(x,)).flops == 30  # a + w*(b-a)


def test_where_reads_bool_condition_at_one_byte():
    cost = price(aten.where.self, spec(10, dtype=torch.bool), spec(10), spec(10), outputs=(spec(10),))
    assert cost == Cost(10, 10 + 2 * 40, 40)


def test_copies_fills_and_dtype_casts():
    x = spec(8, 8)
    assert price(aten._to_copy.default, x, outputs=(spec(8, 8, dtype=torch.float16),), dtype=torch.float16) == \
        Cost(0, 256, 128)  # read 64*4, write 64*2
    assert price(aten.copy_.default, spec(8, 8), spec(8, 8, dtype=torch.bfloat16), outputs=(x,)) == \
        Cost(0, 128, 256)  # src read, dst written, dst not read
    assert price(aten.fill_.Scalar, x, 1.0, outputs=(x,)) == Cost(0, 0, 256)
    assert price(aten.contiguous.default, x, outputs=(x,)) == Cost()  # already contiguous: alias
    xt = spec(8, 4, stride=(1, 8))
    assert price(aten.contiguous.default, xt, outputs=(spec(8, 4),)) == Cost(0, 128, 128)
    assert price(aten.clone.default, x, outputs=(x,)) == Cost(0, 256, 256)


def test_native_dropout_writes_output_and_mask():
    cost = price(aten.native_dropout.default, spec(10), 0.1, True,
                 outputs=(spec(10), spec(10, dtype=torch.bool)))
    assert cost == Cost(30, 40, 40 + 10)  # 3 FLOPs/elem; out (f32) + mask (bool)


# --- reductions, softmax, losses ---------------------------------------------------------------

def test_sum_and_mean():
    x = spec(4, 8)
    assert price(aten.sum.dim_IntList, x, [1], outputs=(spec(4),)) == Cost(32, 128, 16)
    assert price(aten.mean.dim, x, [1], outputs=(spec(4),)).flops == 32 + 4  # adds + one divide per row
    assert price(aten.var_mean.correction, x, [1], outputs=(spec(4), spec(4))) == Cost(3 * 32 + 4, 128, 32)


def test_router_counting_ops_are_modelled():
    """What MoE routers call (GraniteMoE: ``histc`` of expert ids, ``diff`` of offsets, ``&`` of masks): a
    histogram reads its input once (one increment each) and writes its bins; ``diff`` subtracts once per
    output; ``&`` is elementwise. They were priced by bytes and listed as unmodelled."""
    ids = spec(512, dtype=torch.int64)
    assert price(aten.histc.default, spec(512), 4, 0, 3, outputs=(spec(4),)) == Cost(512, 512 * F32, 4 * F32)
    assert price(aten.bincount.default, ids, None, 4, outputs=(spec(4, dtype=torch.int64),)) == \
        Cost(512, 512 * I64, 4 * I64)
    assert price(aten.diff.default, ids, 1, -1, outputs=(spec(511, dtype=torch.int64),)) == \
        Cost(511, 512 * I64, 511 * I64)
    mask = spec(4, 128, dtype=torch.bool)
    assert price(aten.__and__.Tensor, mask, mask, outputs=(mask,)) == Cost(512, 2 * 512, 512)


def test_argmax_writes_int64():
    assert price(aten.argmax.default, spec(4, 8), 1, outputs=(spec(4, dtype=torch.int64),)) == \
        Cost(32, 128, 4 * I64)


def test_max_other_is_elementwise_and_max_dim_is_reduction():
    x = spec(4, 8)
    assert price(aten.max.other, x, x, outputs=(x,)) == Cost(32, 256, 128)
    assert price(aten.max.dim, x, 1, outputs=(spec(4), spec(4, dtype=torch.int64))) == Cost(32, 128, 16 + 32)


def test_softmax_and_backward():
    x = spec(4, 8)
    assert price(aten._softmax.default, x, -1, False, outputs=(x,)) == Cost(5 * 32, 128, 128)
    assert price(aten._log_softmax_backward_data.default, x, x, -1, torch.float32, outputs=(x,)) == \
        Cost(4 * 32, 256, 128)


def test_nll_loss_reads_only_gathered_entries():
    logp, target = spec(32, 100), spec(32, dtype=torch.int64)
    cost = price(aten.nll_loss_forward.default, logp, target, None, 1, -100, outputs=(spec(), spec()))
    assert cost == Cost(32, 32 * I64 + 32 * F32, 2 * F32)  # target + 32 gathered + (loss, total_weight)
    back = price(aten.nll_loss_backward.default, spec(), logp, target, None, 1, -100, spec(),
                 outputs=(logp,))
    assert back == Cost(32, 4 + 32 * I64 + 4, 3200 * F32)  # grad_input fully written (zero fill)


def test_cross_entropy_is_log_softmax_plus_nll():
    logits, target = spec(32, 100), spec(32, dtype=torch.int64)
    ce = price(aten.cross_entropy_loss.default, logits, target, outputs=(spec(),))
    lsm = price(aten._log_softmax.default, logits, 1, False, outputs=(logits,))
    nll = price(aten.nll_loss_forward.default, logits, target, None, 1, -100, outputs=(spec(),))
    assert ce == lsm + nll


# --- norms -----------------------------------------------------------------------------------

def test_layer_norm_forward_and_backward():
    x, w = spec(4, 8), spec(8)
    stats = spec(4, 1)
    fwd = price(aten.native_layer_norm.default, x, [8], w, w, 1e-5, outputs=(x, stats, stats))
    assert fwd == Cost(7 * 32, (32 + 8 + 8) * F32, (32 + 4 + 4) * F32)  # (5+1+1)/elem
    bwd = price(aten.native_layer_norm_backward.default, x, x, [8], stats, stats, w, w, [True, True, True],
                outputs=(x, w, w))
    # grad_input 10/elem; grad_w + grad_b 4+1/elem; each kernel reads grad_out, input, mean, rstd
    assert bwd.flops == 10 * 32 + 5 * 32
    assert bwd.bytes_read == (64 + 8 + 8) * F32 + (64 + 8) * F32  # + weight in the grad_input kernel
    assert bwd.bytes_written == (32 + 8 + 8) * F32


def test_rms_norm():
    x, w = spec(4, 8), spec(8)
    assert price(aten._fused_rms_norm.default, x, [8], w, 1e-6, outputs=(x, spec(4, 1))) == \
        Cost(4 * 32, (32 + 8) * F32, (32 + 4) * F32)  # (3+1)/elem


def test_batch_norm_training_reads_input_twice():
    x, c = spec(2, 4, 3, 3), spec(4)
    train = price(aten._native_batch_norm_legit_functional.default, x, c, c, c, c, True, 0.1, 1e-5,
                  outputs=(x, c, c, c, c))
    assert train.flops == 7 * 72  # stats 3 + transform 4 per element
    assert train.bytes_read == (2 * 72 + 4 * 4) * F32  # input twice + w, b, running mean/var
    evaluation = price(aten._native_batch_norm_legit_no_training.default, x, c, c, c, c, 0.1, 1e-5,
                       outputs=(x, spec(0), spec(0)))
    assert evaluation.flops == 4 * 72
    assert evaluation.bytes_read == (72 + 4 * 4) * F32


def test_group_norm():
    x, c = spec(2, 4, 3, 3), spec(4)
    cost = price(aten.native_group_norm.default, x, c, c, 2, 4, 9, 2, 1e-5,
                 outputs=(x, spec(2, 2), spec(2, 2)))
    assert cost.flops == 7 * 72


# --- indexing ----------------------------------------------------------------------------------

def test_embedding_reads_gathered_rows_only():
    weight, idx = spec(100, 16), spec(2, 8, dtype=torch.int64)
    cost = price(aten.embedding.default, weight, idx, outputs=(spec(2, 8, 16),))
    assert cost == Cost(0, 16 * I64 + 256 * F32, 256 * F32)  # indices + 2*8*16 gathered; 2*8*16 out


def test_embedding_bag_reads_gathered_rows_only_and_its_backward_writes_the_table():
    """A 20000 x 64 table, 64 bags of 4 indices: the forward reads 256 rows, never the 5 MB table (priced by
    its inputs' bytes before it had a rule, 4x its real time in a DLRM-like model); the dense backward
    zero-fills the whole table's gradient and adds the 256 rows' gradients into it."""
    weight, idx, offsets = spec(20000, 64), spec(256, dtype=torch.int64), spec(64, dtype=torch.int64)
    out, offset2bag, bag_size, maximum = (spec(64, 64), spec(256, dtype=torch.int64), spec(64, dtype=torch.int64),
                                          spec(64, dtype=torch.int64))
    cost = price(aten._embedding_bag.default, weight, idx, offsets, outputs=(out, offset2bag, bag_size, maximum))
    assert cost == Cost(256 * 64, 256 * I64 + 64 * I64 + 256 * 64 * F32,
                        64 * 64 * F32 + 256 * I64 + 64 * I64 + 64 * I64)
    grad = spec(64, 64)
    backward = price(aten._embedding_bag_backward.default, grad, idx, offsets, offset2bag, bag_size, maximum, 20000,
                     False, 0, False, None, outputs=(spec(20000, 64),))
    rows = 256 * 64 * F32
    assert backward == Cost(256 * 64, 64 * 64 * F32 + 256 * I64 + 256 * I64 + 64 * I64 + rows,
                            20000 * 64 * F32 + rows)


def test_glu_and_embedding_renorm():
    """GLU halves its input: a * sigmoid(b) per output element (sigmoid's FLOPs + 1), the whole input read;
    Embedding(max_norm) renormalises only the looked-up rows, in place."""
    from boomfx.passes.costs.pointwise import SIGMOID_FLOPS
    glu = price(aten.glu.default, spec(4, 64), -1, outputs=(spec(4, 32),))
    assert glu == Cost(128 * (SIGMOID_FLOPS + 1), 256 * F32, 128 * F32)
    renorm = price(aten.embedding_renorm_.default, spec(100, 16), spec(12, dtype=torch.int64), 1.0, 2.0)
    assert renorm == Cost(3 * 12 * 16, 12 * I64 + 12 * 16 * F32, 12 * 16 * F32)


def test_cat_and_pad_and_factories():
    assert price(aten.cat.default, [spec(2, 3), spec(4, 3)], 0, outputs=(spec(6, 3),)) == Cost(0, 72, 72)
    # a border: the output filled (96 B), then the input copied into its interior (64 B more), as ATen's
    # constant_pad_nd does; no border (or a crop): one narrowed copy
    assert price(aten.constant_pad_nd.default, spec(4, 4), [1, 1], outputs=(spec(4, 6),)) == Cost(0, 64, 96 + 64)
    assert price(aten.constant_pad_nd.default, spec(4, 4), [0, 0], outputs=(spec(4, 4),)) == Cost(0, 64, 64)
    assert price(aten.constant_pad_nd.default, spec(4, 4), [-1, 2], outputs=(spec(4, 5),)) == Cost(0, 64, 80 + 48)
    assert price(aten.constant_pad_nd.default, spec(2, 4, 4), [1, 1, -1, 0], outputs=(spec(2, 3, 6),)) == \
        Cost(0, 128, 144 + 96)
    assert price(aten.zeros.default, [4, 4], outputs=(spec(4, 4),)) == Cost(0, 0, 64)
    assert price(aten.ones_like.default, spec(4, 4), outputs=(spec(4, 4),)) == Cost(0, 0, 64)
    assert price(aten.empty.memory_format, [4, 4], outputs=(spec(4, 4),)) == Cost()
    assert price(aten.arange.default, 16, outputs=(spec(16, dtype=torch.int64),)) == Cost(0, 0, 128)


def test_scatter_add_out_of_place_and_in_place():
    x, idx, src = spec(10, 4), spec(3, 4, dtype=torch.int64), spec(3, 4)
    out_of_place = price(aten.scatter_add.default, x, 0, idx, src, outputs=(x,))
    # copy self (read 160, write 160) + read index 96 + src 48 + RMW of 12 elements (48 read, 48 written)
    assert out_of_place == Cost(12, 48 + 96 + 48 + 160, 48 + 160)
    in_place = price(aten.scatter_add_.default, x, 0, idx, src, outputs=(x,))
    assert in_place == Cost(12, 48 + 96 + 48, 48)


def test_sort_and_topk_approximations():
    x = spec(4, 16)
    sort = price(aten.sort.default, x, outputs=(x, spec(4, 16, dtype=torch.int64)))
    assert sort == Cost(64 * 4, 256, 256 + 512)  # numel*log2(16) compares
    topk = price(aten.topk.default, x, 2, outputs=(spec(4, 2), spec(4, 2, dtype=torch.int64)))
    assert topk == Cost(64, 256, 32 + 64)


# --- views -------------------------------------------------------------------------------------

def test_views_are_free_and_named():
    assert is_view_op(aten.view.default) and is_view_op(aten.transpose) and is_view_op(aten.reshape.default)
    assert not is_view_op(aten.add.Tensor) and not is_view_op(aten.clone.default)
    assert aten.expand in VIEW_OPS
    assert price(aten.permute.default, spec(2, 3), [1, 0], outputs=(spec(3, 2, stride=(1, 3)),)) == Cost()


# --- optimizer ---------------------------------------------------------------------------------

def test_foreach_sums_over_list():
    a, b = spec(4), spec(6)
    cost = price(aten._foreach_add.List, [a, b], [a, b], outputs=([a, b],))
    assert cost == Cost(10, 80, 40)  # 4+6 adds; (4+6)*2 reads; (4+6) writes, in f32
    inplace = price(aten._foreach_mul_.Scalar, [a, b], 0.9, outputs=())
    assert inplace == Cost(10, 40, 40)
    assert price(aten._foreach_copy_.default, [a, b], [a, b], outputs=()) == Cost(0, 40, 40)
    assert price(aten._foreach_addcdiv_.Scalar, [a], [a], [a], 1.0, outputs=()).flops == 12  # 3/elem


def test_fused_adamw():
    p, step = spec(100), spec(dtype=torch.float32)
    cost = price(aten._fused_adamw_.default, [p], [p], [p], [p], [], [step], lr=1e-3, beta1=0.9,
                 beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False, outputs=())
    assert cost.flops == 15 * 100  # 13 + 2 weight decay
    assert cost.bytes_read == 4 * 400 + 4  # p, g, m, v + step
    assert cost.bytes_written == 3 * 400  # p, m, v


def test_fused_sgd_momentum():
    p = spec(100)
    cost = price(aten._fused_sgd_.default, [p], [p], [p], weight_decay=0.0, momentum=0.9, lr=0.1,
                 dampening=0.0, nesterov=False, maximize=False, is_first_step=False, outputs=())
    assert cost == Cost(5 * 100, 3 * 400, 2 * 400)  # update 2 + momentum 3; p, g, buf read; p, buf written


# --- fallback and coverage -------------------------------------------------------------------------

def test_op_without_formula_is_priced_by_bytes_and_flagged():
    x = spec(10)
    priced = price_call(OpCall.build(aten.special_bessel_j0.default, (x,), {}, (x,)))
    assert not priced.modelled
    assert "special_bessel_j0" in priced.reason
    assert priced.cost == Cost(0, 40, 40)


class _Block(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class _GPT(nn.Module):
    def __init__(self, vocab=64, d=32, block=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([_Block(d), _Block(d)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _unmodelled(graph) -> set:
    missing = set()
    for node in graph.nodes:
        call = opcall_from_node(node)
        if call is not None and not price_call(call).modelled:
            missing.add(str(node.target))
    return missing


def test_every_op_of_a_small_gpt_has_a_formula():
    torch.manual_seed(0)
    model = _GPT()
    idx, tgt = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    ep = torch.export.export(model.eval(), (idx, tgt))
    assert _unmodelled(ep.graph) == set()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)

    def train_step(i, t):
        loss = model(i, t)
        loss.backward()
        opt.step()
        return loss

    graph = make_fx(train_step)(idx, tgt).graph
    assert _unmodelled(graph) == set()
    symbolic = torch.export.export(model.eval(), (idx, tgt),
                                   dynamic_shapes={"idx": {0: torch.export.Dim("b")}, "targets": {0: torch.export.Dim("b")}})
    assert _unmodelled(symbolic.graph) == set()
