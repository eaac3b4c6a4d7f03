"""Real tensors for an exported program: weights where the file has none, inputs at the bound sizes.

``boomfx validate`` runs the user's exported graph for real, but a ``.pt2`` written from a meta-device
model (or read by boomfx's loader, which never unpickles weights) holds no data. Values change neither
the kernels a step launches nor the bytes it allocates, only a few data-dependent speeds, so weights are
drawn at random with scales that keep activations finite and normal (no NaN/inf, no denormals, which
run slower on a CPU), and integer inputs stay inside the tables they index.

Known limitations:
- Integer buffers without data are zeros (``position_ids`` become all 0: the same rows are gathered,
  not the same speed as a real batch's distinct rows, a small effect on embedding ops only).
- Integer user inputs are drawn below the row count of the first embedding that reads them, else in
  [0, 2); inputs whose name says ``mask`` are all ones.
- A MoE router with random weights routes tokens more evenly than a trained one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

# Standard deviation of a random matrix weight: 1/sqrt(fan_in) keeps each layer's output at the scale
# of its input (LeCun-normal), so deep stacks stay finite without the model's own initialiser.
WEIGHT_GAIN = 1.0
MASK_WORDS = ("mask",)          # integer/bool inputs named like this are all ones (nothing masked)


@dataclass(frozen=True)
class Materialised:
    """A runnable module of the program with real weights, and its user inputs in call order."""

    module: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    resident_bytes: int          # parameters + buffers + constants + inputs (alive before a step)


def size_of(value: Any, bindings: Mapping[str, int]) -> int:
    """A (Sym)Int dimension at ``bindings`` (symbol name -> value)."""
    if isinstance(value, torch.SymInt):
        expr = sympy.sympify(value.node.expr)
        subs = {s: sympy.Integer(bindings[str(s)]) for s in expr.free_symbols if str(s) in bindings}
        out = expr.xreplace(subs)
        if out.free_symbols:
            raise KeyError(f"unbound symbol(s) {sorted(map(str, out.free_symbols))}")
        return int(out)
    return int(value)


def _random_like(name: str, t: torch.Tensor, device: torch.device, gen: torch.Generator,
                 kind: InputKind) -> torch.Tensor:
    shape = tuple(t.shape)
    if not t.dtype.is_floating_point:
        if t.dtype == torch.bool:
            return torch.ones(shape, dtype=t.dtype, device=device)
        return torch.zeros(shape, dtype=t.dtype, device=device)
    if kind != InputKind.PARAMETER:      # running statistics, rotary tables, masks: positive, finite
        return torch.ones(shape, dtype=t.dtype, device=device)
    if t.dim() < 2:                      # norm scales 1, biases 0: the usual initial values
        fill = 1.0 if name.endswith("weight") else 0.0
        return torch.full(shape, fill, dtype=t.dtype, device=device)
    fan_in = math.prod(shape[1:])
    out = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(WEIGHT_GAIN / math.sqrt(fan_in))
    return out.to(device=device, dtype=t.dtype)


def materialise(ep: ExportedProgram, bindings: Mapping[str, int], device: torch.device | str = "cpu",
                seed: int = 0) -> Materialised:
    """``ep.module()`` on ``device`` with real weights (kept where the program has data, random where it
    holds meta tensors) and random user inputs at ``bindings`` (symbol name -> size).

    Example::

        >>> m = materialise(torch.export.load("mlp.pt2"), {"s0": 32})
        >>> m.module(*m.args, **m.kwargs)
    """
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    module = ep.module()
    _move_factories(module, device)
    kinds = {spec.target: spec.kind for spec in ep.graph_signature.input_specs if spec.target is not None}
    with torch.no_grad():
        # parameters and every buffer, non-persistent ones too (rotary tables are not in the state_dict)
        named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
        done: dict[int, torch.Tensor] = {}
        for name, tensor in named:
            _replace(module, name, tensor, device, gen, kinds.get(name, InputKind.BUFFER), done)
        for owner_path, owner in module.named_modules():   # lifted constants held as plain attributes,
            for name, value in list(vars(owner).items()):   # on submodules too (BEiT's relative position bias)
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    full = f"{owner_path}.{name}" if owner_path else name
                    setattr(owner, name, _real(full, value, device, gen, InputKind.CONSTANT_TENSOR))
    args, kwargs = _user_inputs(ep, bindings, device, gen)
    tensors = list(module.parameters()) + list(module.buffers()) + _flat(args, kwargs)
    tensors += [v for owner in module.modules() for v in vars(owner).values() if isinstance(v, torch.Tensor)]
    resident = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return Materialised(module, args, kwargs, sum(resident.values()))


def _move_factories(module: torch.nn.Module, device: torch.device) -> None:
    """A model exported on the meta device bakes ``device=meta`` into its factory calls (``arange`` of
    positions, causal masks) and their metadata checks: they create tensors on ``device`` instead."""
    for gm in module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        changed = False
        for node in gm.graph.nodes:
            dev = node.kwargs.get("device")
            if node.op == "call_function" and isinstance(dev, torch.device) and dev.type == "meta":
                node.kwargs = {**node.kwargs, "device": device}
                changed = True
        if changed:
            gm.recompile()


def _real(name: str, t: torch.Tensor, device: torch.device, gen: torch.Generator, kind: InputKind) -> torch.Tensor:
    if t.device.type == "meta":
        return _random_like(name, t, device, gen, kind)
    return t.detach().to(device)


def _replace(module: torch.nn.Module, name: str, tensor: torch.Tensor, device: torch.device,
             gen: torch.Generator, kind: InputKind, done: dict[int, torch.Tensor]) -> None:
    """Put real data under ``name``; a tensor reached under two names (tied weights) stays one tensor."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if id(tensor) in done:
        new = done[id(tensor)]
        if isinstance(new, torch.nn.Parameter):
            setattr(owner, leaf, new)
        else:
            owner._buffers[leaf] = new
        return
    data = _real(name, tensor, device, gen, kind)
    if isinstance(tensor, torch.nn.Parameter):
        new = torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
        done[id(tensor)] = new
        setattr(owner, leaf, new)
        return
    done[id(tensor)] = data
    if leaf in owner._buffers:
        owner._buffers[leaf] = data
    else:
        setattr(owner, leaf, data)


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    return list(torch.utils._pytree.tree_flatten((args, kwargs))[0])


def _embedding_rows(ep: ExportedProgram) -> dict[str, int]:
    """User input name -> rows of the first embedding table indexed by it (bounds for random ids)."""
    rows: dict[str, int] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or "embedding" not in str(node.target):
            continue
        weight, index = node.args[0], node.args[1]
        if isinstance(index, torch.fx.Node) and index.op == "placeholder" and isinstance(weight, torch.fx.Node):
            val = weight.meta.get("val")
            if isinstance(val, torch.Tensor):
                rows.setdefault(index.name, int(val.shape[0]))
    return rows


def _user_inputs(ep: ExportedProgram, bindings: Mapping[str, int], device: torch.device,
                 gen: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Random user inputs, reassembled into the export's (args, kwargs) structure."""
    rows = _embedding_rows(ep)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    flat: list[Any] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        name = getattr(spec.arg, "name", None)
        val = placeholders[name].meta.get("val") if name in placeholders else getattr(spec.arg, "value", None)
        flat.append(_random_input(name or "", val, bindings, device, gen, rows.get(name or "")))
    spec_tree = ep.call_spec.in_spec
    if spec_tree is None:
        return tuple(flat), {}
    args, kwargs = torch.utils._pytree.tree_unflatten(flat, spec_tree)
    return tuple(args), dict(kwargs)


def _random_input(name: str, val: Any, bindings: Mapping[str, int], device: torch.device,
                  gen: torch.Generator, rows: int | None) -> Any:
    if not isinstance(val, torch.Tensor):
        return size_of(val, bindings) if isinstance(val, torch.SymInt) else val
    shape = tuple(size_of(d, bindings) for d in val.shape)
    if val.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(device=device, dtype=val.dtype)
    if val.dtype == torch.bool or any(w in name.lower() for w in MASK_WORDS):
        return torch.ones(shape, dtype=val.dtype, device=device)
    return torch.randint(0, rows or 2, shape, generator=gen).to(device=device, dtype=val.dtype)
