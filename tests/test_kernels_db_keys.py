"""Kernel keys: canonical, concrete-only, and real inputs that run the op with the keyed layout."""

from __future__ import annotations

import sympy
import pytest
import torch

from boomfx.kernels_db.collectors import build_call, spec, transposed
from boomfx.kernels_db.keys import SymbolicKeyError, kernel_key, make_inputs, op_name, shrunk_key
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec

aten = torch.ops.aten
CPU = torch.device("cpu")


def test_equal_calls_equal_keys_and_layout_matters() -> None:
    a = kernel_key(
        build_call(aten.mm.default, (spec((64, 32), torch.float32), spec((32, 16), torch.float32)))
    )
    b = kernel_key(
        build_call(aten.mm.default, (spec((64, 32), torch.float32), spec((32, 16), torch.float32)))
    )
    t = kernel_key(
        build_call(aten.mm.default, (spec((64, 32), torch.float32), transposed((32, 16), torch.float32)))
    )
    assert a == b and a.key_hash == b.key_hash
    assert t.key_hash != a.key_hash  # a transposed operand is a different kernel
    assert a.op == "aten.mm.default" and a.dtype == "float32"
    assert op_name(aten.add.Tensor) == "aten.add.Tensor"


def test_flags_and_scalars_are_part_of_the_key() -> None:
    q = spec((1, 2, 8, 4), torch.float32)
    causal = kernel_key(build_call(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, True)))
    full = kernel_key(build_call(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0, False)))
    assert causal.key_hash != full.key_hash
    assert causal.data["args"]["is_causal"] is True


def test_symbolic_sizes_raise_a_clear_error() -> None:
    s0 = sympy.Symbol("s0")
    call = OpCall.build(
        aten.relu.default,
        (TensorSpec((s0, sympy.Integer(4)), (sympy.Integer(4), sympy.Integer(1)), torch.float32),),
        {},
    )
    with pytest.raises(SymbolicKeyError, match="s0"):
        kernel_key(call)


def test_make_inputs_reproduces_strides_and_runs() -> None:
    key = kernel_key(
        build_call(aten.mm.default, (spec((64, 32), torch.float32), transposed((32, 16), torch.float32)))
    )
    op, args, kwargs = make_inputs(key, CPU)
    assert args[1].shape == (32, 16) and args[1].stride() == (1, 32)
    assert op(*args, **kwargs).shape == (64, 16)


def test_storage_offset_is_reproduced() -> None:
    offset_spec = TensorSpec((sympy.Integer(4),), (sympy.Integer(2),), torch.float32, sympy.Integer(3))
    key = kernel_key(OpCall.build(aten.relu.default, (offset_spec,), {}))
    _, args, _ = make_inputs(key, CPU)
    assert (args[0].storage_offset(), args[0].stride()) == (3, (2,))


def test_index_tensors_stay_in_range() -> None:
    emb = kernel_key(
        build_call(aten.embedding.default, (spec((50, 8), torch.float32), spec((1000,), torch.int64)))
    )
    _, args, _ = make_inputs(emb, CPU)
    assert 0 <= int(args[1].min()) and int(args[1].max()) < 50
    gather = kernel_key(
        build_call(aten.gather.default, (spec((6, 300), torch.float32), 1, spec((6, 40), torch.int64)))
    )
    op, args, kwargs = make_inputs(gather, CPU)
    assert int(args[2].max()) < 300
    op(*args, **kwargs)
    nll = kernel_key(
        build_call(
            aten.nll_loss_forward.default,
            (spec((32, 10), torch.float32), spec((32,), torch.int64), None, 1, -100),
        )
    )
    op, args, kwargs = make_inputs(nll, CPU)
    assert int(args[1].max()) < 10
    op(*args, **kwargs)


def test_grouped_mm_offsets_split_every_group_evenly() -> None:
    """Random offsets left most experts empty (the fallback measured 7x fast); the rebuilt ``offs`` are
    cumulative ends that cover the grouped dimension, so the product computes every row."""
    bf16 = torch.bfloat16
    tokens, k, n, experts = 12, 8, 8, 3
    call = build_call(aten._grouped_mm.default, (spec((tokens, k), bf16), spec((experts, k, n), bf16),
                                                 spec((experts,), torch.int32)))
    op, args, kwargs = make_inputs(kernel_key(call), CPU)
    assert args[2].tolist() == [4, 8, 12]
    x, w = args[:2]
    expected = torch.cat([x[4 * g:4 * (g + 1)].float() @ w[g].float() for g in range(experts)])
    assert torch.allclose(op(*args, **kwargs).float(), expected, rtol=2e-2)
    # groups along K (2-D x 2-D) and along N (3-D x 2-D) split those sizes
    along_k = build_call(aten._grouped_mm.default, (spec((8, 16), bf16), spec((16, 8), bf16),
                                                    spec((2,), torch.int32)))
    assert make_inputs(kernel_key(along_k), CPU)[1][2].tolist() == [8, 16]
    along_n = build_call(aten._grouped_mm.default, (spec((2, 8, 8), bf16), spec((8, 24), bf16),
                                                    spec((2,), torch.int32)))
    assert make_inputs(kernel_key(along_n), CPU)[1][2].tolist() == [12, 24]


def test_transformers_grouped_mm_fallback_runs_every_expert() -> None:
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
    fallback = torch.ops.transformers.grouped_mm_fallback.default
    call = build_call(fallback, (spec((10, 6), torch.float32), spec((4, 6, 5), torch.float32),
                                 spec((4,), torch.int64)))
    op, args, kwargs = make_inputs(kernel_key(call), CPU)
    assert args[2].tolist() == [2, 5, 7, 10]
    out = op(*args, **kwargs)
    bounds = [0, 2, 5, 7, 10]
    expected = torch.cat([args[0][bounds[g]:bounds[g + 1]] @ args[1][g] for g in range(4)])
    assert torch.allclose(out, expected) and bool((out != 0).all())


def test_embedding_bag_offsets_start_at_zero_and_split_the_indices() -> None:
    """Random offsets were refused by the op ('offsets[0] has to be 0'): the call was never measured."""
    weight, indices = spec((1000, 16), torch.float32), spec((400,), torch.int64)
    call = build_call(aten._embedding_bag.default, (weight, indices, spec((8,), torch.int64)))
    op, args, kwargs = make_inputs(kernel_key(call), CPU)
    assert args[2].tolist() == [0, 50, 100, 150, 200, 250, 300, 350]
    assert int(args[1].max()) < 1000 and int(args[1].max()) >= 16      # indices span the table's rows
    bags = op(*args, **kwargs)[0]
    assert bags.shape == (8, 16)
    assert torch.allclose(bags[1], args[0][args[1][50:100]].sum(0), rtol=1e-4)
    last = build_call(aten._embedding_bag.default, (weight, indices, spec((5,), torch.int64), False, 0, False,
                                                    None, True))
    op, args, kwargs = make_inputs(kernel_key(last), CPU)
    assert args[2].tolist() == [0, 100, 200, 300, 400]
    assert op(*args, **kwargs)[0].shape == (4, 16)


def test_optional_tensor_lists_and_bool_masks() -> None:
    key = kernel_key(
        build_call(aten.index.Tensor, (spec((10, 20), torch.float32), [None, spec((7,), torch.int64)]))
    )
    op, args, kwargs = make_inputs(key, CPU)
    assert op(*args, **kwargs).shape == (10, 7)
    mask = kernel_key(
        build_call(
            aten.masked_fill.Scalar, (spec((4, 4), torch.float32), spec((4, 4), torch.bool), float("-inf"))
        )
    )
    op, args, kwargs = make_inputs(mask, CPU)
    assert args[1].dtype == torch.bool and args[2] == float("-inf")
    op(*args, **kwargs)


def test_tensor_lists_and_in_place_ops() -> None:
    params = [spec((3, 4), torch.float32), spec((5,), torch.float32)]
    key = kernel_key(build_call(aten._foreach_add_.List, (params, params), {"alpha": 0.5}))
    op, args, kwargs = make_inputs(key, CPU)
    before = args[0][1].clone()
    assert op(*args, **kwargs) is None
    assert torch.allclose(args[0][1], before + 0.5 * args[1][1])
    cat = kernel_key(build_call(aten.cat.default, (params[:1] * 3, 0)))
    op, args, kwargs = make_inputs(cat, CPU)
    assert op(*args, **kwargs).shape == (9, 4)


def test_factory_ops_take_the_measurement_device() -> None:
    call = OpCall.build(
        aten.full.default,
        ([sympy.Integer(2), sympy.Integer(3)], 1.5),
        {"dtype": torch.float16, "device": torch.device("meta")},
    )
    op, args, kwargs = make_inputs(kernel_key(call), CPU)
    out = op(*args, **kwargs)
    assert out.device == CPU and out.dtype == torch.float16


def test_shrunk_key_keeps_structure() -> None:
    key = kernel_key(
        build_call(aten.mm.default, (spec((64, 32), torch.float32), spec((32, 16), torch.float32)))
    )
    tiny = shrunk_key(key)
    assert [t["shape"] for t in tiny.data["tensors"]] == [[1, 1], [1, 1]]
    assert tiny.op == key.op and tiny.key_hash != key.key_hash
