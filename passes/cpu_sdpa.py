"""Attention as a compiled CPU graph runs it: the dispatcher's decomposition of ``scaled_dot_product_attention``.

An exported inference graph calls the composite ``aten.scaled_dot_product_attention``. Eagerly, the composite
decides inside one op; under ``torch.compile`` AOTAutograd traces through it (CompositeImplicitAutograd) and
Inductor compiles what it calls (attention.cpp, torch 2.13): on a CPU, when ``_fused_sdp_choice`` picks flash
attention, ``_scaled_dot_product_flash_attention_for_cpu`` (an extern kernel that returns the output and a
``[batch, heads, queries]`` fp32 log-sum-exp) after ``convert_boolean_attn_mask``: a boolean mask becomes
``where(mask, 0, -inf)`` in the query's dtype, of the mask's (broadcast) shape. Inductor generates that
``where`` as a kernel of its own, fused with whatever computed the mask, and stores its output: a
transformers mask is an ``expand`` of a ``[1, 1, q, kv]`` pattern to the batch, so the stored float mask is
``batch x q x kv`` elements, allocated before the attention and, like any buffer, kept in Inductor's reuse pool
for the next mask of its size (``passes/buffer_reuse.py``). Read in the output code of a compiled BART
inference (``cpp_fused__scaled_dot_product_flash_attention_for_cpu_..._where``, ``buf7 = empty_strided_cpu((4,
1, 128, 128), ...)``): the masks and the log-sum-exps were 192 KiB of its 3.46 MiB peak that the composite
did not show.

``decompose_cpu_attention(program)`` rewrites each composite call of a compiled CPU program whose
decomposition, asked of the dispatcher itself at the example sizes (a recording dispatch mode over fake
tensors: no memory is touched), runs the CPU flash kernel. Calls the dispatcher sends to the math path
(dropout, 3-D inputs, unequal head dims) keep the composite. GPU targets are left alone: CUDA's choice among
its kernels and their mask padding are not the CPU's and are not measured here.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from boomfx.core.program import Program
from boomfx.passes.layout import size_hint

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class _OpRecorder(TorchDispatchMode):
    """The aten ops a call reaches after the composite decompositions above the Python dispatch key."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    values = dict(_DEFAULTS)
    values.update(zip(_ARGS, node.args))
    values.update(node.kwargs)
    return values


def _described(value: Any, program: Program) -> Any:
    """An argument as the dispatcher's choice sees it: a tensor's sizes, strides (at the example sizes) and
    dtype; anything else as it is."""
    if not isinstance(value, torch.fx.Node):
        return value
    val = value.meta.get("val")
    return (tuple(int(size_hint(s, program)) for s in val.shape),
            tuple(int(size_hint(s, program)) for s in val.stride()), val.dtype, val.device)


def _runs_cpu_flash(args: dict[str, Any], program: Program, memo: dict[tuple, bool]) -> bool:
    """Whether the dispatcher's decomposition of this call, at the example sizes, runs the CPU flash kernel
    (``memo``: the answers by described arguments; a model's repeated layers ask once, ~4 ms a question)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    if any(not isinstance(args[k], torch.fx.Node) or not isinstance(args[k].meta.get("val"), torch.Tensor)
           for k in ("query", "key", "value")):
        return False
    if args["attn_mask"] is not None and not isinstance(args["attn_mask"], torch.fx.Node):
        return False
    described = {k: _described(v, program) for k, v in args.items()}
    key = tuple(described[k] for k in _ARGS)
    if key not in memo:
        recorder = _OpRecorder()
        try:
            with FakeTensorMode(allow_non_fake_inputs=False):
                fakes = {k: torch.empty_strided(v[0], v[1], dtype=v[2], device=v[3])
                         if isinstance(args[k], torch.fx.Node) else v for k, v in described.items()}
                with recorder:
                    SDPA(fakes["query"], fakes["key"], fakes["value"], fakes["attn_mask"], fakes["dropout_p"],
                         fakes["is_causal"], scale=fakes["scale"], enable_gqa=fakes["enable_gqa"])
            memo[key] = FLASH_CPU in recorder.ops
        except Exception:       # noqa: BLE001 - a call the dispatcher refuses at these sizes: leave it as exported
            memo[key] = False
    return memo[key]


def _float_mask(graph: torch.fx.Graph, mask: torch.fx.Node, dtype: torch.dtype, mode: Any) -> torch.fx.Node:
    """``convert_boolean_attn_mask``: ``where(mask, 0, -inf)`` in the query's dtype."""
    device = mask.meta["val"].device
    zero = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": dtype, "device": device})
    minus_inf = graph.call_function(aten.scalar_tensor.default, (-math.inf,), {"dtype": dtype, "device": device})
    where = graph.call_function(aten.where.self, (mask, zero, minus_inf))
    with mode:
        zero.meta["val"] = torch.scalar_tensor(0.0, dtype=dtype, device=device)
        minus_inf.meta["val"] = torch.scalar_tensor(-math.inf, dtype=dtype, device=device)
        where.meta["val"] = torch.where(mask.meta["val"], zero.meta["val"], minus_inf.meta["val"])
    return where


def decompose_cpu_attention(program: Program) -> Program:
    """``program`` with the composite attention calls of a compiled CPU graph decomposed as the dispatcher
    decomposes them (module docstring); the same program when there is none to rewrite."""
    if getattr(program.options, "target_kind", "cpu") != "cpu":
        return program
    memo: dict[tuple, bool] = {}
    calls = [n for n in program.graph.nodes if n.op == "call_function" and n.target is SDPA
             and _runs_cpu_flash(_arguments(n), program, memo)]
    if not calls:
        return program
    graph, val_map = program.copied_graph()
    phases = dict(program.phases)
    mode = next(v.fake_mode for n in graph.nodes for v in [n.meta.get("val")] if hasattr(v, "fake_mode"))
    for original in calls:
        node = val_map[original]
        args = _arguments(node)
        query = args["query"].meta["val"]
        mask: Optional[torch.fx.Node] = args["attn_mask"]
        inserted: list[torch.fx.Node] = []
        with graph.inserting_before(node):
            if mask is not None and mask.meta["val"].dtype == torch.bool:
                mask = _float_mask(graph, mask, query.dtype, mode)
                inserted.extend([mask, *mask.args[1:]])
            kwargs = {"attn_mask": mask, "scale": args["scale"]}
            call = graph.call_function(FLASH_CPU, (args["query"], args["key"], args["value"],
                                                   float(args["dropout_p"]), bool(args["is_causal"])), kwargs)
            output = graph.call_function(operator.getitem, (call, 0))
        with mode:
            call.meta["val"] = FLASH_CPU(query, args["key"].meta["val"], args["value"].meta["val"],
                                         float(args["dropout_p"]), bool(args["is_causal"]),
                                         attn_mask=mask.meta["val"] if mask is not None else None,
                                         scale=args["scale"])
        output.meta["val"] = call.meta["val"][0]
        for key in ("nn_module_stack", "stack_trace", "seq_nr"):
            if key in node.meta:
                for new in (call, output, *inserted):
                    new.meta[key] = node.meta[key]
        if node.name in phases:
            for new in (call, output, *inserted):
                phases[new.name] = phases[node.name]
        node.replace_all_uses_with(output)
        graph.erase_node(node)
    return program.rewritten(graph, phases=phases)
