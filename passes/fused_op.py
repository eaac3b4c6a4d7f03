"""The custom op ``boomfx::fused`` that a fused Inductor kernel is keyed, priced and run as, and ``FusedKernel``,
the fx target of one fused node (see passes/compiled.py for the rewrite that creates them).

``boomfx::fused(Tensor[] inputs, SymInt[] scalars, str desc) -> Tensor[]``: ``desc`` is a canonical JSON
description of the member ops and their wiring (references to inputs ``$in``, member results ``$v`` and
size scalars ``$s``). The kernel database keys it like any aten call; running it for real compiles the
group with Inductor (``run_fused``), which is what ``kernels_db/collect_fused.py`` times.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any, Optional, Sequence

import sympy
import torch
import torch.fx

from boomfx.passes.costs.registry import Cost, OpCall
from boomfx.passes.op_names import op_from_name
from boomfx.passes.specs import TensorSpec, to_sympy

# ---------------------------------------------------------------------------------------------------------
# The custom op a fused kernel is keyed and run as
# ---------------------------------------------------------------------------------------------------------

_LIB: Optional[torch.library.Library] = None


def fused_op() -> torch._ops.OpOverload:
    """``torch.ops.boomfx.fused.default``, defined on first use."""
    global _LIB
    if _LIB is None:
        if not hasattr(torch.ops.boomfx, "fused"):
            _LIB = torch.library.Library("boomfx", "DEF")
            _LIB.define("fused(Tensor[] inputs, SymInt[] scalars, str desc) -> Tensor[]")
            _LIB.impl("fused", _fused_impl, "CompositeExplicitAutograd")
        else:  # defined by an earlier import of this module under another name
            _LIB = torch.library.Library("boomfx", "FRAGMENT")
    return torch.ops.boomfx.fused.default


def _fused_impl(inputs: Sequence[torch.Tensor], scalars: Sequence[int], desc: str) -> list[torch.Tensor]:
    return list(run_fused(desc, tuple(int(s) for s in scalars), inputs))


# ---------------------------------------------------------------------------------------------------------
# Descriptions: member ops with references to inputs ($in), member results ($v) and size scalars ($s)
# ---------------------------------------------------------------------------------------------------------


def encode(value: Any, ref: Any, scalars: list) -> Any:
    if isinstance(value, torch.fx.Node):
        return ref(value)
    if isinstance(value, (list, tuple)):
        return [encode(v, ref, scalars) for v in value]
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        value = to_sympy(value)
    if isinstance(value, sympy.Basic) and not value.free_symbols:
        value = int(value) if value.is_Integer else float(value)
    if isinstance(value, sympy.Basic):
        scalars.append(value)
        return {"$s": len(scalars) - 1}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": None}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).removeprefix("torch.")}
    raise TypeError(f"cannot describe an argument of type {type(value).__name__} in a fused kernel")


def _decode(value: Any, env: dict, device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(v, env, device) for v in value]
    if isinstance(value, dict):
        if "$in" in value:
            return env["in"][value["$in"]]
        if "$v" in value:
            return env["v"][value["$v"]]
        if "$s" in value:
            return env["s"][value["$s"]]
        if "$dtype" in value:
            return getattr(torch, value["$dtype"])
        if "$device" in value:
            return device
        if "$layout" in value:
            return getattr(torch, value["$layout"])
        if "$memory_format" in value:
            return getattr(torch, value["$memory_format"])
        if "$float" in value:
            return float(value["$float"])
    return value


def _interpret(desc: dict, inputs: Sequence[torch.Tensor], scalars: Sequence[int]) -> list[torch.Tensor]:
    device = inputs[0].device if inputs else torch.device("cpu")
    env: dict = {"in": list(inputs), "v": [], "s": list(scalars)}
    for name, args, kwargs in desc["ops"]:
        fn = op_from_name(name)
        kw = {k: _decode(v, env, device) for k, v in kwargs.items()}
        env["v"].append(fn(*_decode(args, env, device), **kw))
    return [env["v"][i] for i in desc["outputs"]]


@lru_cache(maxsize=None)
def _compiled(desc: str, scalars: tuple[int, ...], signature: tuple) -> Any:
    """The group compiled by Inductor for one set of input shapes (no dynamo guards on the call)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = json.loads(desc)
    example = [torch.empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype in signature]

    def fn(*inputs: torch.Tensor) -> list[torch.Tensor]:
        return _interpret(spec, inputs, scalars)

    gm = make_fx(fn, tracing_mode="fake")(*example)   # fake: the empty inputs hold no valid indices
    return compile_fx(gm, example)


def compiled_group(desc: str, scalars: tuple[int, ...], inputs: Sequence[torch.Tensor]) -> Any:
    """The Inductor-compiled callable of a fused group for the shapes, strides and dtypes of ``inputs``."""
    signature = tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in inputs)
    return _compiled(desc, scalars, signature)


def run_fused(desc: str, scalars: tuple[int, ...], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run a fused kernel for real, compiled by Inductor (cached per shapes)."""
    out = compiled_group(desc, scalars, inputs)(*inputs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


# ---------------------------------------------------------------------------------------------------------
# The fx target
# ---------------------------------------------------------------------------------------------------------


class FusedKernel:
    """The target of one fused node: the members' description, its inputs/outputs and its Cost.

    ``cost.flops`` is the sum of the members' FLOPs (symbolic); bytes are the external tensor inputs
    read once and the outputs written once: intermediates stay in registers.
    """

    overloadpacket = None         # not an aten op: never in an op set of the other passes
    boomfx_fused = True           # what the hooks in kernels.py / shapes.py test for
    __name__ = "fused"

    def __init__(self, name: str, members: tuple[str, ...], ops: tuple[str, ...], desc: str,
                 n_tensor_inputs: int, scalars: tuple[Any, ...], input_specs: tuple[TensorSpec, ...],
                 output_specs: tuple[TensorSpec, ...], cost: Cost, phase: str) -> None:
        self.name = name
        self.members = members
        self.ops = ops
        self.desc = desc
        self.n_tensor_inputs = n_tensor_inputs
        self.scalars = scalars
        self.input_specs = input_specs
        self.output_specs = output_specs
        self.cost = cost
        self.phase = phase
        self.inplace: tuple = (None,) * len(output_specs)
        # a ConcatKernel's copy of a view input (fusion.FusionGroup.into_concat): the cat it writes into
        self.into_concat: Optional[str] = None

    def __repr__(self) -> str:
        return f"FusedKernel({self.name}: {' + '.join(self.ops)})"

    def __call__(self, *args: Any) -> Any:
        tensors = args[:self.n_tensor_inputs]
        scalars = [int(a) for a in args[self.n_tensor_inputs:]]
        spec = json.loads(self.desc)
        out = _interpret(spec, tensors, scalars)
        return out[0] if len(out) == 1 else tuple(out)

    def output_aliases(self, node: torch.fx.Node) -> list:
        """Per output: ``(input node, True)`` when it is written in place into a dead input, else None."""
        return [(node.args[i], True) if i is not None else None for i in self.inplace]

    def opcall(self) -> OpCall:
        """The OpCall of ``boomfx::fused`` the pricer keys and the roofline prices."""
        return OpCall(fused_op(), {"inputs": list(self.input_specs), "scalars": list(self.scalars),
                                   "desc": self.desc}, tuple(self.output_specs), {})
