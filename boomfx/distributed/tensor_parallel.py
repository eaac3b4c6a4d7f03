"""Tensor parallelism (Megatron column/row split) as a rewrite of the forward export, then re-traced.

One TP rank runs the model with its slice of each planned linear: a ``colwise`` linear holds
``out_features / tp`` rows of its weight (and bias), a ``rowwise`` one ``in_features / tp`` columns
(its bias stays whole). Everything between them follows: the attention heads and key/value heads,
the MLP width. ``shard_export`` walks the export graph once, tracking which dimension of each value
is split (``None``: replicated), and rewrites what hard-codes a full size (``view``/``reshape``
sizes, ``expand`` sizes); an op whose split it cannot follow raises a one-line OptionError naming
the op, never a silently wrong shape. Collectives go where DTensor's ``ColwiseParallel`` /
``RowwiseParallel`` (default layouts) issue them, as custom ops (``tp_ops.py``):

- forward: each rowwise linear's partial output is all-reduced (``Partial -> Replicate``);
- backward: each colwise linear's input gradient is all-reduced (``from_local`` of a ``Replicate``
  input), one per linear, as DTensor does (q, k and v: three), not one per group as Megatron's ``f``.

The rewritten export is traced as a training step exactly as ``capture`` traces the original
(``capture.trace_step``), so gradients, AdamW state and activations have the rank's shapes, and
the custom ops are lowered to ``_c10d_functional.all_reduce`` + ``wait_tensor`` on the ``tp`` group.

Plan: ``model_shape.tp_plan`` (derived from module names inside the layer list, or ``--tp-plan``).

Vocabulary-parallel ends (``--tp-plan torchtitan``, torchtitan's Llama plan with loss parallel
off): a rowwise embedding holds ``vocab / tp`` rows, masks the ids outside them (``MaskPartial``)
and all-reduces its partial output; a split value the model returns (the colwise head's logits) is
all-gathered to Replicate (``ColwiseParallel(output_layouts=Replicate())``).

GPT-2's ``Conv1D`` (``addmm(bias, x, weight [in, out])``) splits like a linear on the transposed
dimensions (colwise: weight dim 1; rowwise: dim 0).

A ``colwise_packed`` projection (a fused q|k|v or gate|up weight) holds 1/tp of every part, as
vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``: its local output is the parts' local
blocks side by side, so a bound the model splits the output at (a ``slice``, ``split``, ``chunk``,
or a ``view`` that makes the parts a dimension) is the global bound / tp (``_Sharder.packed``). The
parts are only known where the model splits them: any other use of the packed output is refused.
Its memory, FLOPs and collectives are a colwise linear's.

A per-head table (T5's ``relative_attention_bias``: an embedding of [buckets, heads] whose lookup
becomes SDPA's per-head mask) planned colwise is split on its heads, and each rank looks up its own
heads; a replicated per-head mask reaching a head-split SDPA is sliced to the rank's heads (a view).

Sequence parallelism (``sp``, with the torchtitan plan): the activations between blocks are split
on the sequence dim (``Shard(1)``); the first colwise projection reading a seq-split value
all-gathers it once (``sp_gather``: q, k and v share it, as behind torchtitan's
``PrepareModuleInput``), its backward reduce-scatters the summed input gradient; the rowwise outputs
and the embedding's partial output are reduce-scattered (``sp_scatter``), their backward
all-gathers. The head's seq-split input stays alive until its logits are gathered (the caller's
frame holds a module's argument).

The vocabulary-parallel embedding's weight gradient is then made the whole table, as DTensor
computes and keeps it (``vocab_embedding_grad.py``).

Known limitations:
- ``sp`` needs the torchtitan plan (the embedding's output goes straight into ``Shard(1)``).
- Under ``sp`` DTensor leaves the norm weights' gradients ``Partial`` and AdamW's foreach ops
  all-reduce them on each read (3 per weight, [d] each, measured on gloo): not in the program.
- The masked ids of a vocabulary-parallel embedding are saved for its backward here (autograd's
  embedding saves its indices); DTensor frees them and re-masks in backward: [batch, seq] int64 more.
- A rowwise linear's bias is added on every rank before the all-reduce (DTensor adds ``bias / tp``
  as a ``Partial`` operand): the same shapes and memory, a different sum.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx as fx

from boomfx.core.errors import OptionError
from boomfx.core.fx_copy import copy_graph
from boomfx.core.layers import find_layer_list, module_path
from boomfx.core.program import Program
from boomfx.distributed import tp_ops
from boomfx.distributed.loss_parallel import vocab_parallel_cross_entropy
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.vocab_embedding_grad import replicated_embedding_grads

aten = torch.ops.aten
Split = Optional[int]  # the split dimension of a value, None when replicated


@dataclasses.dataclass(frozen=True)
class Packed:
    """The output of a ``colwise_packed`` projection: split on ``dim`` part by part (module docstring)."""

    dim: int
    source: str = ""  # the projection's module path, for messages

_POINTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.mul.Scalar,
    aten.sub.Scalar, aten.div.Scalar, aten.neg.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.tanh.default, aten.sigmoid.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default,
    aten.pow.Tensor_Scalar, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.dropout.default, aten.type_as.default, aten.alias.default,
    aten.detach.default, aten.reciprocal.default, aten.where.self, aten.masked_fill.Scalar,
    aten.cos.default, aten.sin.default, aten.square.default, aten.abs.default, aten.erf.default,
    aten.gelu_.default, aten.silu_.default, aten.relu_.default, aten.mul_.Tensor, aten.add_.Tensor,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Tensor,
    aten.minimum.default, aten.maximum.default, aten.clamp.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.log.default,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_FULL_TRANSPOSES = {aten.numpy_T.default, aten.t.default}
_SDPA = {aten.scaled_dot_product_attention.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var.correction}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
_SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}
_IGNORED = {aten._assert_tensor_metadata.default, aten.sym_size.int}
_COLWISE = ("colwise", "colwise_packed")


def _fail(node: fx.Node, why: str) -> OptionError:
    where = module_path(node)
    return OptionError(f"--parallel tp: cannot split {node.name} ({node.target}{' in ' + where if where else ''}): {why}")


def _ndim(node: Any) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _shape(node: fx.Node) -> list[sympy.Expr]:
    out = []
    for s in node.meta["val"].shape:
        out.append(s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s)))
    return out


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class _Sharder:
    """One pass over the export graph: the split of every value, the edits to sizes, the custom ops."""

    def __init__(self, graph: fx.Graph, plan: Mapping[str, str], params: Mapping[str, str], tp: int,
                 seq_len: Optional[fx.Node] = None, split_logits: Optional[fx.Node] = None) -> None:
        self.graph = graph
        # loss parallelism: the model's logits, returned split on the vocabulary (not gathered)
        self.split_logits = split_logits
        self.tp = tp
        self.seq_len = seq_len  # sequence parallelism: the graph's full sequence length (a sym_size node)
        self.gathered: dict[fx.Node, fx.Node] = {}  # a seq-split value -> its one all-gather
        self.seq_inputs: dict[fx.Node, fx.Node] = {}  # a colwise linear -> the seq-split value it gathered
        self.style = {name: plan[fqn] for name, fqn in params.items() if fqn in plan}  # placeholder -> style
        self.fqn = dict(params)
        self.split: dict[fx.Node, Any] = {}

    # -- helpers -------------------------------------------------------------------------------
    def of(self, arg: Any) -> Split:
        return self.split.get(arg) if isinstance(arg, fx.Node) else None

    def tensors(self, node: fx.Node) -> list[fx.Node]:
        """The tensor-valued nodes ``node`` reads (in args and kwargs, lists included)."""
        return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]

    def local(self, node: fx.Node, size: Any) -> Any:
        """The per-rank size of a split dimension's size argument (``-1`` stays)."""
        if isinstance(size, int):
            if size == -1:
                return size
            if size % self.tp:
                raise _fail(node, f"its size {size} does not divide by tp={self.tp}")
            return size // self.tp
        raise _fail(node, "the split dimension's size is symbolic")

    # -- the walk ------------------------------------------------------------------------------
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                self.split[node] = self.placeholder(node)
            elif node.op == "output":
                for arg in self.tensors(node):
                    if arg is self.split_logits and self.of(arg) == _ndim(arg) - 1:
                        continue  # loss parallel: each rank's [.., vocab / tp] logits go to the loss
                    if isinstance(self.of(arg), Packed):
                        raise _fail(arg, "a packed projection's output reaches the model's output unsplit")
                    if self.of(arg) is not None:
                        self.gather_output(node, arg)
            elif node.op == "call_function":
                self.split[node] = self.call(node)

    def looks_up_input(self, weight: fx.Node) -> bool:
        """Whether an embedding weight is looked up by a model input (a token embedding)."""
        return any(u.target is aten.embedding.default and u.args[0] is weight and isinstance(u.args[1], fx.Node)
                   and u.args[1].op == "placeholder" for u in weight.users)

    def placeholder(self, node: fx.Node) -> Split:
        style = self.style.get(node.name)
        if style is None:
            return None
        val = node.meta["val"]
        fqn = self.fqn[node.name]
        if style == "rowwise" and val.dim() == 1:
            return None  # a rowwise bias stays whole
        if _is_embedding_weight(node):
            if style == "colwise_packed":
                raise OptionError(f"--tp-plan: {fqn}: colwise_packed is for a fused projection, not an embedding")
            if style == "colwise" and _is_linear_weight(node):
                dim = 0  # a head tied to the embedding: the vocabulary rows
            elif style == "colwise" and self.looks_up_input(node):
                raise OptionError(f"--tp-plan: {fqn}: a colwise (embedding-dimension) split of a token embedding is "
                                  "not built (rowwise, the vocabulary-parallel one, is)")
            else:  # rowwise: rows of the vocabulary; colwise: a per-head table's heads (T5's position bias)
                dim = 0 if style == "rowwise" else 1
        elif _is_conv1d_weight(node):  # GPT-2's Conv1D: addmm(bias, x, weight [in, out])
            dim = 1 if style in _COLWISE else 0
        else:
            dim = 0 if style in _COLWISE else 1  # colwise: output rows (and bias); rowwise: input columns
        if val.shape[dim] % self.tp:
            raise OptionError(f"--parallel: tp={self.tp} does not divide {fqn} ({style}: dimension {val.shape[dim]})")
        shape = list(val.shape)
        shape[dim] //= self.tp
        node.meta["val"] = torch.empty(shape, dtype=val.dtype, device="meta")
        return dim

    def call(self, node: fx.Node) -> Any:
        target = node.target
        if target is aten.linear.default:
            return self.linear(node)
        if target is aten.addmm.default and isinstance(node.args[2], fx.Node) and _is_conv1d_weight(node.args[2]):
            return self.conv1d(node)
        if target is aten.embedding.default and self.of(node.args[0]) == 1:
            if self.of(node.args[1]) is not None:
                raise _fail(node, "the looked-up ids are split")
            return _ndim(node) - 1  # a per-head table split on its heads: each rank looks up its own heads
        if target is aten.embedding.default and self.of(node.args[0]) is not None:
            return self.vocab_embedding(node)
        inputs = self.tensors(node)
        splits = [self.of(a) for a in inputs]
        if target is operator.getitem:
            parent = self.split.get(node.args[0])
            return parent[node.args[1]] if isinstance(parent, list) else parent
        if any(isinstance(s, Packed) for s in splits):
            return self.packed(node, inputs)
        if all(s is None for s in splits):
            return [None] * len(node.meta["val"]) if isinstance(node.meta.get("val"), (list, tuple)) else None
        if target in _IGNORED:
            return None
        if target in _POINTWISE:
            return self.pointwise(node, inputs)
        if target in _VIEWS:
            return self.view(node)
        if target is aten.transpose.int:
            d, nd = self.of(node.args[0]), _ndim(node)
            a, b = _dim(node.args[1], nd), _dim(node.args[2], nd)
            return b if d == a else a if d == b else d
        if target is aten.permute.default:
            return [_dim(p, _ndim(node)) for p in node.args[1]].index(self.of(node.args[0]))
        if target is aten.unsqueeze.default:
            d, at = self.of(node.args[0]), _dim(node.args[1], _ndim(node))
            return d + 1 if d >= at else d
        if target is aten.expand.default:
            return self.expand(node)
        if target is aten.repeat_interleave.self_int:
            return self.of(node.args[0])  # per split head: each rank repeats its own kv heads
        if target in _SPLITS or target is aten.slice.Tensor or target is aten.select.int:
            return self.split_op(node)
        if target is aten.cat.default:
            return self.cat(node)
        if target is aten.stack.default:
            return self.stack(node)
        if target is aten.flatten.using_ints:
            return self.flatten(node)
        if target in _SDPA:
            return self.sdpa(node)
        if target in _SOFTMAX:
            if _dim(node.args[1], _ndim(node)) == self.of(node.args[0]):
                raise _fail(node, "a softmax over the split dimension")
            return self.of(node.args[0])
        if target in _REDUCTIONS:
            return self.reduction(node)
        if target is aten.layer_norm.default:
            d, nd = self.of(node.args[0]), _ndim(node)
            if d is not None and d >= nd - len(node.args[1]):
                raise _fail(node, "a normalisation over the split dimension")
            if any(self.of(a) is not None for a in node.args[2:4]):
                raise _fail(node, "split normalisation weights")
            return d
        if target in _FULL_TRANSPOSES:   # ``w.T`` / ``w.t()``: every dimension reversed
            return _ndim(node) - 1 - self.of(node.args[0])
        if target is aten.matmul.default and self.transposed_weight(node.args[1]) is not None:
            return self.weight_matmul(node)
        if target in (aten.matmul.default, aten.bmm.default):
            return self.batched_matmul(node)
        raise _fail(node, "no tensor-parallel rule for this op (give a --tp-plan that keeps it replicated)")

    def linear(self, node: fx.Node) -> Split:
        x, w = node.args[0], node.args[1]
        style = self.style.get(w.name) if isinstance(w, fx.Node) else None
        if style is not None and _is_embedding_weight(w):
            style = "colwise"  # a head tied to the embedding: its weight is split on the vocabulary rows
        d = self.of(x)
        nd = _ndim(node)
        if style is None:
            if d is not None:
                raise _fail(node, "a replicated linear reads a split input (plan its module rowwise)")
            return None
        if style in _COLWISE:
            out: Any = Packed(nd - 1, module_path(node)) if style == "colwise_packed" else nd - 1
            if d is not None and self.seq_len is not None and d == nd - 2:
                node.replace_input_with(x, self.gather_sequence(x))
                self.seq_inputs[node] = x
                return out
            if d is not None:
                raise _fail(node, "a colwise linear reads a split input (DTensor would all-gather it)")
            with self.graph.inserting_before(node):
                entered = self.graph.call_function(tp_ops.REGION_ENTER, (x,))
            entered.meta.update({k: v for k, v in x.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            entered.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            node.replace_input_with(x, entered)
            self.split[entered] = None
            return out
        if d is None:
            raise _fail(node, "a rowwise linear reads a replicated input: the projection feeding it is not split "
                        "(a fused one the derived plan does not know by name stays replicated); give a --tp-plan "
                        "that plans it colwise_packed, or leaves both replicated")
        if d != nd - 1:
            raise _fail(node, "a rowwise linear reads an input not split on its last dimension")
        return self.reduce_partial(node)

    def reduce_partial(self, node: fx.Node) -> Split:
        """A partial sum made whole: all-reduced, or under sequence parallelism reduce-scattered
        along the sequence (``output_layouts=Shard(1)``)."""
        if self.seq_len is not None:
            with self.graph.inserting_after(node):
                scattered = self.graph.call_function(tp_ops.SP_SCATTER, (node, 1, self.tp))
            # (the walk reasons in the export's global shapes: the value keeps its full shape)
            scattered.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            node.replace_all_uses_with(scattered, delete_user_cb=lambda user: user is not scattered)
            self.split[scattered] = 1
            return "partial"
        with self.graph.inserting_after(node):
            reduced = self.graph.call_function(tp_ops.ALL_REDUCE, (node,))
        reduced.meta.update({k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
        self.split[reduced] = None
        return "partial"

    def conv1d(self, node: fx.Node) -> Split:
        """GPT-2's Conv1D, ``addmm(bias, x [N, in], weight [in, out])``: colwise splits the weight's
        columns and the bias, rowwise its rows (the bias stays whole), with the same collectives as a
        linear (Megatron's; DTensor's styles do not take Conv1D)."""
        bias, x, w = node.args[:3]
        style = self.style.get(w.name)
        d = self.of(x)
        if style is None:
            if d is not None or self.of(bias) is not None:
                raise _fail(node, "a replicated Conv1D reads a split input (plan its module rowwise)")
            return None
        if style in _COLWISE:
            if d is not None:
                raise _fail(node, "a colwise Conv1D reads a split input")
            with self.graph.inserting_before(node):
                entered = self.graph.call_function(tp_ops.REGION_ENTER, (x,))
            entered.meta.update({k: v for k, v in x.meta.items() if k in ("val", "stack_trace")})
            entered.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
            node.replace_input_with(x, entered)
            self.split[entered] = None
            return Packed(1, module_path(node)) if style == "colwise_packed" else 1
        if d != 1:
            raise _fail(node, "a rowwise Conv1D reads an input not split on its last dimension")
        return self.reduce_partial(node)

    def vocab_embedding(self, node: fx.Node) -> Split:
        """RowwiseParallel on an embedding (token ids replicated): as DTensor's ``MaskPartial``, the
        ids outside this rank's vocabulary block are masked to 0 and shifted into it, the lookup runs
        on the local rows and its partial output is all-reduced. (The real runtime also zeroes the
        masked rows of the output in place: no memory, not in the graph.)"""
        weight, ids = node.args[0], node.args[1]
        if self.of(ids) is not None:
            raise _fail(node, "the token ids are split")
        rows = int(weight.meta["val"].shape[0])  # already the local block

        def add(target: Any, args: tuple, like: fx.Node) -> fx.Node:
            with self.graph.inserting_before(node):
                new = self.graph.call_function(target, args)
            new.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
            for key in ("nn_module_stack", "stack_trace"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            self.split[new] = None
            return new

        mask = add(aten.bitwise_or.Tensor, (add(aten.lt.Scalar, (ids, 0), ids), add(aten.ge.Scalar, (ids, rows), ids)), ids)
        shifted = add(aten.sub.Scalar, (add(aten.clone.default, (ids,), ids), 0), ids)  # ids - this rank's offset
        local_ids = add(aten.masked_fill.Scalar, (shifted, mask, 0), ids)
        node.replace_input_with(ids, local_ids)
        return self.reduce_partial(node)

    def gather_sequence(self, x: fx.Node) -> fx.Node:
        """The one all-gather along the sequence of a seq-split value (torchtitan's
        ``PrepareModuleInput``: q, k and v, or gate and up, share it)."""
        if x not in self.gathered:
            with self.graph.inserting_after(x):
                g = self.graph.call_function(tp_ops.SP_GATHER, (x, 1, self.tp, self.seq_len))
            g.meta.update({k: v for k, v in x.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
            self.split[g] = None
            self.gathered[x] = g
        return self.gathered[x]

    def gather_output(self, out: fx.Node, arg: fx.Node) -> None:
        """A split value the model returns (a colwise output head): all-gathered back to Replicate, as
        torchtitan's ``ColwiseParallel(output_layouts=Replicate())`` head without loss parallel."""
        d = self.of(arg)
        if d == "partial":
            raise _fail(arg, "a partial sum reaches the model's output")
        with self.graph.inserting_before(out):
            gathered = self.graph.call_function(tp_ops.ALL_GATHER, (arg, d, self.tp, self.seq_inputs.get(arg)))
        gathered.meta.update({k: v for k, v in arg.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        out.replace_input_with(arg, gathered)
        self.split[gathered] = None

    def pointwise(self, node: fx.Node, inputs: Sequence[fx.Node]) -> Split:
        nd = _ndim(node)
        out: Split = None
        for a in inputs:
            s = self.of(a)
            if s == "partial":
                raise _fail(node, "reads a partial sum")
            if s is not None:
                aligned = s + nd - _ndim(a)
                if out is not None and out != aligned:
                    raise _fail(node, "its operands are split on different dimensions")
                out = aligned
        for a in inputs:
            if self.of(a) is None and _ndim(a) > 0:
                pos = out - (nd - _ndim(a))
                if pos >= 0 and _shape(a)[pos] != 1:
                    raise _fail(node, f"a replicated operand ({a.name}) spans the split dimension")
        return out

    def view(self, node: fx.Node) -> Split:
        src = node.args[0]
        d = self.of(src)
        ins, outs = _shape(src), _shape(node)
        # group the dimensions where the prefix products agree: a view maps groups to groups
        group_in, group_out = _group(ins, outs, d)
        if group_in is None:
            raise _fail(node, "the view splits or merges the split dimension with a dimension before it")
        first = next((j for j in group_out if outs[j] != 1), None)
        if first is None:
            raise _fail(node, "the split dimension disappears in the view")
        self.divide_view(node, first, outs)
        return first

    def divide_view(self, node: fx.Node, j: int, outs: list[sympy.Expr]) -> None:
        """Rewrite size ``j`` of a view to the rank's; an inferred ``-1`` stays, once its size is known to divide."""
        sizes = list(node.args[1])
        if sizes[j] == -1 and outs[j].is_Integer and int(outs[j]) % self.tp:
            raise _fail(node, f"its inferred size {outs[j]} does not divide by tp={self.tp}")
        sizes[j] = self.local(node, sizes[j])
        node.args = (node.args[0], sizes, *node.args[2:])

    def packed(self, node: fx.Node, inputs: Sequence[fx.Node]) -> Any:
        """An op reading a packed projection's output. Where it splits the packed dimension into parts
        (a slice, split, chunk, or a view whose first dimension counts the parts) each local bound is
        the global one / tp, and the parts come out split like any colwise output; a cast or an op on
        another dimension keeps it packed; anything else is refused."""
        src = node.args[0]
        p = self.of(src)
        if not isinstance(p, Packed) or any(self.of(a) is not None for a in inputs if a is not src):
            raise _fail(node, "it reads a packed projection's output with other split values")
        nd_in, target = _ndim(src), node.target
        if target in _IGNORED:
            return None
        if target in _POINTWISE and len(inputs) == 1:
            return dataclasses.replace(p, dim=p.dim + _ndim(node) - nd_in)
        if target in _VIEWS:
            return self.packed_view(node, p)
        if target in (aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            dim = _dim(node.args[1] if target is aten.slice.Tensor else
                       node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd_in)
            if dim != p.dim:
                return [p] * len(node.meta["val"]) if isinstance(node.meta["val"], (list, tuple)) else p
            size = _shape(src)[dim]
            if not size.is_Integer:
                raise _fail(node, "the packed dimension's size is symbolic")
            self.split_parts(node, int(size))
            return [dim] * len(node.meta["val"]) if isinstance(node.meta["val"], (list, tuple)) else dim
        raise _fail(node, f"the packed output of {p.source or 'a projection'} is read other than split into its parts "
                    "(by a slice, split, chunk or view); give a --tp-plan that plans it colwise or leaves it replicated")

    def split_parts(self, node: fx.Node, size: int) -> None:
        """Rewrite the bounds at which ``node`` cuts a packed dimension of ``size`` to each rank's."""
        args = list(node.args)
        if node.target is aten.slice.Tensor:
            start, end = (args + [None, None, None])[2:4]
            step = args[4] if len(args) > 4 else 1
            if step != 1:
                raise _fail(node, "a strided slice of a packed projection's output")
            bounds = []
            for bound in (0 if start is None else start, size if end is None else end):
                bound = min(max(bound + size if bound < 0 else bound, 0), size)
                if bound % self.tp:
                    raise _fail(node, f"the packed part's bound {bound} does not divide by tp={self.tp}")
                bounds.append(bound // self.tp)
            node.args = (args[0], args[1], *bounds, *args[4:])
        elif node.target is aten.split.Tensor:
            node.args = (args[0], self.local(node, args[1]), *args[2:])
        elif node.target is aten.split_with_sizes.default:
            node.args = (args[0], [self.local(node, s) for s in args[1]], *args[2:])
        elif size % (args[1] * self.tp):  # chunk: the same count of parts, each 1/tp
            raise _fail(node, f"{args[1]} parts of {size} do not divide by tp={self.tp}")

    def packed_view(self, node: fx.Node, p: Packed) -> Any:
        """A view of a packed output: the packed dimension kept whole stays packed; split as
        ``[parts, ...]`` (``view(b, t, 3, heads, head_dim)``) the dimension after the parts is divided."""
        src = node.args[0]
        ins, outs = _shape(src), _shape(node)
        group_in, group_out = _group(ins, outs, p.dim)
        dims = [j for j in group_out if outs[j] != 1]
        if group_in is None or not dims:
            raise _fail(node, "the view merges the packed dimension with a dimension before it")
        if len(dims) == 1:
            self.divide_view(node, dims[0], outs)
            return dataclasses.replace(p, dim=dims[0])
        self.divide_view(node, dims[1], outs)  # dims[0] counts the parts
        return dims[1]

    def expand(self, node: fx.Node) -> Split:
        src = node.args[0]
        d = self.of(src) + _ndim(node) - _ndim(src)
        sizes = list(node.args[1])
        if sizes[d] != -1:
            sizes[d] = self.local(node, sizes[d])
        node.args = (src, sizes, *node.args[2:])
        return d

    def split_op(self, node: fx.Node) -> Any:
        src = node.args[0]
        d = self.of(src)
        nd_in = _ndim(src)
        if node.target in (aten.unbind.int, aten.select.int, aten.slice.Tensor):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        else:  # chunk / split / split_with_sizes: (self, chunks or sizes, dim)
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if _dim(dim, nd_in) == d:
            raise _fail(node, "it slices the split dimension")
        if node.target is aten.select.int or node.target is aten.unbind.int:
            d = d - 1 if d > _dim(dim, nd_in) else d
        if isinstance(node.meta.get("val"), (list, tuple)):
            return [d] * len(node.meta["val"])
        return d

    def cat(self, node: fx.Node) -> Split:
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else 0
        splits = {self.of(p) for p in parts}
        if len(splits) != 1:
            raise _fail(node, "it joins split and replicated values")
        (d,) = splits
        if _dim(dim, _ndim(node)) == d:
            raise _fail(node, "it concatenates along the split dimension")
        return d

    def stack(self, node: fx.Node) -> Split:
        """Values split alike, stacked along a new dimension (GPT-J's rotary ``stack((-x2, x1), -1)``)."""
        splits = {self.of(p) for p in node.args[0]}
        if len(splits) != 1 or "partial" in splits:
            raise _fail(node, "it stacks split and replicated values")
        (d,) = splits
        at = _dim(node.args[1] if len(node.args) > 1 else 0, _ndim(node))
        return d + 1 if d >= at else d

    def flatten(self, node: fx.Node) -> Split:
        """``flatten(x, start, end)``: a split dimension before or after the merged run keeps its place; as
        the run's first dimension (each rank's block stays contiguous) it becomes the merged one."""
        d, nd_in = self.of(node.args[0]), _ndim(node.args[0])
        start = _dim(node.args[1] if len(node.args) > 1 else 0, nd_in)
        end = _dim(node.args[2] if len(node.args) > 2 else -1, nd_in)
        if d < start:
            return d
        if d > end:
            return d - (end - start)
        if d == start:
            return start
        raise _fail(node, "it merges the split dimension with a dimension before it")

    def sdpa(self, node: fx.Node) -> Split:
        q, k, v = node.args[:3]
        heads = _ndim(q) - 3
        if {self.of(q), self.of(k), self.of(v)} != {heads}:
            raise _fail(node, "query, key and value must all be split by head")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and _ndim(mask) == _ndim(q) and _shape(mask)[heads] != 1:
            if self.of(mask) is None:
                self.local_heads(node, mask, heads)
            elif self.of(mask) != heads:
                raise _fail(node, "a per-head attention mask is split on another dimension")
        elif isinstance(mask, fx.Node) and self.of(mask) is not None:
            raise _fail(node, "the attention mask is split but not per head")
        return heads

    def local_heads(self, node: fx.Node, mask: fx.Node, heads: int) -> None:
        """A replicated per-head mask (T5's cross-attention bias, ``zeros(1, heads, q, k)``): each rank
        reads its heads' block, a view (the graph is every rank's: the block at 0 stands for each)."""
        size = _shape(mask)[heads]
        if not size.is_Integer or int(size) % self.tp:
            raise _fail(node, f"a per-head attention mask of {size} heads does not divide by tp={self.tp}")
        with self.graph.inserting_before(node):
            block = self.graph.call_function(aten.slice.Tensor, (mask, heads, 0, int(size) // self.tp))
        block.meta.update({k: v for k, v in mask.meta.items() if k in ("val", "nn_module_stack", "stack_trace")})
        node.replace_input_with(mask, block)
        self.split[block] = heads

    def reduction(self, node: fx.Node) -> Split:
        src = node.args[0]
        d, nd_in = self.of(src), _ndim(src)
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(nd_in))
        dims = [_dim(x, nd_in) for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if d in dims:
            raise _fail(node, "a reduction over the split dimension")
        keep = len(node.args) > 2 and bool(node.args[2]) or bool(node.kwargs.get("keepdim", False))
        return d if keep else d - sum(1 for x in dims if x < d)

    def transposed_weight(self, arg: Any) -> Optional[fx.Node]:
        """The planned 2-D weight ``arg`` transposes (``w.T``, ``w.t()``), else None."""
        if not (isinstance(arg, fx.Node) and arg.target in _FULL_TRANSPOSES):
            return None
        w = arg.args[0]
        planned = isinstance(w, fx.Node) and w.op == "placeholder" and w.name in self.style
        return w if planned and _ndim(w) == 2 else None

    def weight_matmul(self, node: fx.Node) -> Split:
        """``x @ w.T`` of a planned weight (Falcon's ``FalconLinear``) is ``linear(x, w)``: rewritten as one, it
        splits and reduces as ``nn.Linear`` does (the re-trace lowers both to the same matmul)."""
        x, transposed = node.args[0], node.args[1]
        node.target = aten.linear.default
        node.args = (x, self.transposed_weight(transposed))
        if not transposed.users:
            self.graph.erase_node(transposed)
        return self.linear(node)

    def batched_matmul(self, node: fx.Node) -> Split:
        a, b = node.args[:2]
        da, db, nd = self.of(a), self.of(b), _ndim(node)
        if da is None or db is None or da != db or da >= nd - 2:
            raise _fail(node, "a matmul is only split along a batch dimension both operands share")
        return da


def _is_conv1d_weight(node: fx.Node) -> bool:
    """A weight read untransposed as addmm's second matrix: [in, out] (transformers' Conv1D)."""
    return node.op == "placeholder" and any(u.target is aten.addmm.default and u.args[2] is node for u in node.users)


def _is_embedding_weight(node: fx.Node) -> bool:
    return any(u.target is aten.embedding.default and u.args[0] is node for u in node.users)


def _is_linear_weight(node: fx.Node) -> bool:
    return any(u.target is aten.linear.default and u.args[1] is node for u in node.users)


def _plan_over_ties(ep: Any, plan: Mapping[str, str]) -> dict[str, str]:
    """The plan with every name of a tied weight planned alike. The program merges a tie under one
    name (GPT-2's ``transformer.wte.weight``) while the export reads another (``lm_head.weight``, for
    the embedding and the head); planned by one name only, the read weight would stay whole. A tied
    embedding and head (Megatron's shared embedding, vLLM's tied ``ParallelLMHead``) both split the
    vocabulary rows: the embedding is vocabulary-parallel, the head colwise."""
    from boomfx.frontend.ties import find_ties

    planned = dict(plan)
    for group in find_ties(ep):
        styles = {plan[fqn] for fqn in group if fqn in plan}
        if len(styles) > 1:
            raise OptionError(f"--tp-plan: the tied weights {', '.join(group)} are planned differently "
                              f"({', '.join(sorted(styles))}); plan them as one")
        if styles:
            style = styles.pop()
            planned.update({fqn: style for fqn in group})
    return planned


def _group(ins: list[sympy.Expr], outs: list[sympy.Expr], d: int) -> tuple[Optional[list[int]], list[int]]:
    """(input dims, output dims) of the view group holding input dim ``d`` (groups: the shortest runs
    of dims whose size products agree); None when ``d`` is not the group's first non-unit input
    dimension (its per-rank slice would not be one contiguous block of the output)."""
    i = j = 0
    while i < len(ins) or j < len(outs):
        si, sj = i, j
        pi = pj = sympy.Integer(1)
        if i < len(ins):
            pi, i = pi * ins[i], i + 1
        if j < len(outs):
            pj, j = pj * outs[j], j + 1
        while sympy.expand(pi - pj) != 0:
            if _needs_more_output(pi, pj) and j < len(outs):
                pj, j = pj * outs[j], j + 1
            elif i < len(ins):
                pi, i = pi * ins[i], i + 1
            else:
                return None, []
        if si <= d < i:
            group = list(range(si, i))
            lead = next((k for k in group if ins[k] != 1), d)
            return (group if lead == d else None), list(range(sj, j))
    return None, []


def _needs_more_output(pi: sympy.Expr, pj: sympy.Expr) -> bool:
    """Whether the input run's product is the larger (so the output run must grow)."""
    num, den = sympy.fraction(sympy.cancel(pi / pj))
    if num.free_symbols:
        return True
    if den.free_symbols:
        return False
    return bool(num > den)


def shard_export(ep: Any, plan: Mapping[str, str], tp: int, sp: bool = False,
                 loss_parallel: bool = False) -> SimpleNamespace:
    """A duck-typed export (what ``training._trace`` reads) of one TP rank's forward. ``loss_parallel``:
    the logits stay split on the vocabulary and the export brings its own ``cross_entropy``
    (``loss_parallel.vocab_parallel_cross_entropy``) for the trace's loss."""
    from boomfx.frontend.capture import export_param_names

    gm = fx.GraphModule(ep.graph_module, _copy_graph(ep.graph))
    params = export_param_names(ep)
    logits = _first_user_output(gm.graph, ep) if loss_parallel else None
    sharder = _Sharder(gm.graph, _plan_over_ties(ep, plan), params, tp, _sequence_length(gm.graph, ep) if sp else None,
                       split_logits=logits)
    sharder.run()
    if logits is not None and sharder.of(logits) != _ndim(logits) - 1:
        raise OptionError("--parallel tp with loss parallel: the model's output is not split on the vocabulary "
                          "(its head is not column-parallel); give --loss-parallel false")
    gm.graph.lint()
    gm.recompile()
    extra = {"cross_entropy": vocab_parallel_cross_entropy} if loss_parallel else {}
    return SimpleNamespace(graph=gm.graph, graph_module=gm, graph_signature=ep.graph_signature,
                           range_constraints=ep.range_constraints, state_dict=ep.state_dict, **extra)


def _first_user_output(graph: fx.Graph, ep: Any) -> Optional[fx.Node]:
    """The node of the export's first user output (the logits the loss reads)."""
    from torch.export.graph_signature import OutputKind

    out = next(n for n in graph.nodes if n.op == "output")
    for arg, spec in zip(out.args[0], ep.graph_signature.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            return arg if isinstance(arg, fx.Node) else None
    return None


def _sequence_length(graph: fx.Graph, ep: Any) -> fx.Node:
    """``sym_size(token ids, 1)``: the full sequence length, for sequence parallelism's all-gathers."""
    inputs = set(ep.graph_signature.user_inputs)
    ids = next((n for n in graph.nodes if n.op == "placeholder" and n.name in inputs and _ndim(n) == 2), None)
    if ids is None:
        raise OptionError("--parallel sp: the model has no [batch, seq] token input to split the sequence of")
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        size = graph.call_function(aten.sym_size.int, (ids, 1))
    size.meta["val"] = ids.meta["val"].shape[1]
    return size


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    output = new.output(copy_graph(new, graph, {}))      # copy_graph copies every other node's meta
    output.meta = dict(graph.find_nodes(op="output")[0].meta)
    return new


def module_plan(program: Program, cfg: ParallelConfig) -> dict[str, str]:
    """Weight and bias FQNs of the planned linears -> style (``model_shape.tp_plan`` plus biases)."""
    from boomfx.distributed.model_shape import tp_plan

    plan = tp_plan(program, cfg)
    if not plan:
        raise OptionError(f"--parallel tp={cfg.tp}: no linear of the model matches the tensor-parallel plan "
                          "(derived: q/k/v/o, gate/up/down, fc/fc_out inside the layer list; or give --tp-plan)")
    for fqn, style in list(plan.items()):
        plan[fqn[: -len("weight")] + "bias"] = style
    return plan


def tp_rank_program(program: Program, cfg: ParallelConfig) -> Program:
    """The training program of one TP rank (every rank of a TP group runs the same one).

    Kept per program and TP setting: the re-trace is most of a TP plan's build, and the plans of a
    ``--search`` (or the rank classes of one world) that share ``tp`` share it; the FSDP, DDP and
    pipeline rewrites copy the graph they are given, so the kept program is never edited."""
    key = ("tensor_parallel", cfg.tp, cfg.sp, cfg.tp_plan, cfg.vocab_parallel, cfg.loss_parallel, cfg.backend)
    if key not in program.derived:
        program.derived[key] = _build_tp_rank_program(program, cfg)
    return program.derived[key]


def uses_loss_parallel(cfg: ParallelConfig, loss: str) -> bool:
    """torchtitan's default: loss parallel on when the head is vocabulary-parallel (``--tp-plan
    torchtitan``) and the loss is cross-entropy; ``--loss-parallel true`` where it cannot apply is refused."""
    if cfg.loss_parallel is None:
        return cfg.vocab_parallel and loss == "cross_entropy"
    if cfg.loss_parallel and loss != "cross_entropy":
        raise OptionError(f"--loss-parallel true needs a cross-entropy loss (this step's loss is {loss}: "
                          "give --loss cross_entropy)")
    return cfg.loss_parallel


def _build_tp_rank_program(program: Program, cfg: ParallelConfig) -> Program:
    from boomfx.frontend.capture import export_of, program_from_traced, trace_step
    from boomfx.training.trace import resolved_loss

    if cfg.sp and not cfg.vocab_parallel:
        raise OptionError("--parallel sp: sequence parallelism is built with torchtitan's plan (--tp-plan torchtitan)")
    ep = export_of(program)
    if ep is None or not program.options.train:
        raise OptionError("--parallel tp needs the training program captured from its export "
                          "(boomfx.frontend.capture.capture with train=True)")
    plan = module_plan(program, cfg)
    if program.options.stack_depth is not None:   # a depth probe: the export's other layers split alike
        plan = _over_every_layer(plan, ep)
    # the loss as the whole model's (a rank's logits need not look like a vocabulary's)
    # foreach: every rank rewrite starts from the foreach step (ranks.foreach_step)
    options = dataclasses.replace(program.options, loss=resolved_loss(ep, program.options.loss), foreach=True)
    try:
        sharded = _sharded_export(ep, plan, cfg.tp, cfg.sp, uses_loss_parallel(cfg, options.loss))
    except OptionError as err:   # say what to do instead, where the reason does not
        raise OptionError(str(err) if "--tp-plan" in str(err) else f"{err}; {_instead(cfg)}") from None
    traced = trace_step(sharded, options)
    local = program_from_traced(traced, program.symbols, program.options, program.source)
    local = tp_ops.lower_tp_ops(local, gather_scratch=cfg.backend == "gloo")
    return replicated_embedding_grads(local, _vocab_parallel_rows(ep, plan))


# per export (its graph module, held weakly: the shardings go with it), each sharding made: the programs of
# one export at several depths (a search's probes) share one sharded export, hence one truncated re-trace
# (``training/truncate.py`` keeps it per export)
_SHARDED: "weakref.WeakKeyDictionary[fx.GraphModule, dict[tuple, SimpleNamespace]]" = weakref.WeakKeyDictionary()


def _sharded_export(ep: Any, plan: Mapping[str, str], tp: int, sp: bool, loss_parallel: bool) -> SimpleNamespace:
    kept = _SHARDED.setdefault(ep.graph_module, {})
    key = (tuple(sorted(plan.items())), tp, sp, loss_parallel)
    if key not in kept:
        kept[key] = shard_export(ep, plan, tp, sp=sp, loss_parallel=loss_parallel)
    return kept[key]


def _over_every_layer(plan: Mapping[str, str], ep: Any) -> dict[str, str]:
    """``plan`` with each layer entry (``model.layers.3.mlp.up_proj.weight``) repeated for every layer of the
    export: a program synthesised at a reduced depth (``ProgramOptions.stack_depth``) names only some of
    them, and the export it re-traces from must split all its layers alike to be truncated."""
    from boomfx.training.checkpointing import layer_names

    prefix = find_layer_list(ep.graph)
    if prefix is None:
        return dict(plan)
    indices = [name.rsplit(".", 1)[1] for name in layer_names(ep.graph, prefix)]
    out = dict(plan)
    for fqn, style in plan.items():
        head, _, rest = fqn[len(prefix) + 1:].partition(".") if fqn.startswith(prefix + ".") else ("", "", "")
        if head.isdigit():
            out.update({f"{prefix}.{i}.{rest}": style for i in indices})
    return out


def _instead(cfg: ParallelConfig) -> str:
    """What a user can do instead when this model's TP split cannot be followed."""
    if cfg.sp:
        return "try tp without sp instead (sp is modelled for Llama-style blocks)"
    return ("give a --tp-plan that leaves this module replicated instead, or parallelise with dp_shard/pp "
            "without tp")


def _vocab_parallel_rows(ep: Any, plan: Mapping[str, str]) -> dict[str, int]:
    """FQN -> vocabulary rows of each embedding weight the plan splits rowwise (vocabulary-parallel)."""
    params = ep.graph_signature.inputs_to_parameters
    return {params[n.name]: int(n.meta["val"].shape[0]) for n in ep.graph.nodes
            if n.op == "placeholder" and n.name in params and plan.get(params[n.name]) == "rowwise"
            and _is_embedding_weight(n)}
