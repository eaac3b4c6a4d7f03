"""Kernel keys: the canonical identity of one op call with concrete sizes, and real inputs to run it.

``kernel_key(call)`` turns an ``OpCall`` (sizes bound to ints) into a ``KernelKey`` whose JSON is::

    {"op": "aten.mm.default",
     "args": {"self": {"$t": 0}, "mat2": {"$t": 1}},          # every schema argument, tensors as slots
     "tensors": [{"arg": "self", "shape": [64, 32], "stride": [1, 64], "dtype": "float32", "offset": 0},
                 {"arg": "mat2", ...}],
     "context": {}}                                             # target choices from OpCall.context

Transposes are visible in the strides, scalars/flags/dims are in ``args`` (dtype/device/layout values
as ``{"$dtype": ...}``-style tags; a ``{"$device": null}`` slot means "the measurement device").
``make_inputs(key, device)`` rebuilds random tensors with exactly those strides and offsets, with
integer tensors inside the valid range of the op that indexes with them.

Example::

    >>> key = kernel_key(call)            # call: OpCall of aten.mm with int sizes
    >>> op, args, kwargs = make_inputs(key, torch.device("cpu"))
    >>> out = op(*args, **kwargs)

Known limitations:
- Integer tensors whose valid range this module does not know get values in ``[0, smallest dim)``,
  always valid as indices but possibly unrealistic for data-dependent kernels. The group offsets of
  grouped matmuls (``offs``: MoE experts) are the exception: random values there made most groups
  empty (a 7x too-fast measurement of transformers' fallback), so they are set to balanced cumulative
  ends (``INT_VALUES``), the split the cost rule assumes (``passes/costs/grouped_mm.py``); so are
  ``embedding_bag``'s bag offsets (random ones were refused by the op: never measured).
- Float tensors are uniform in [0.25, 0.75): valid for log/sqrt/BCE-style domains, not e.g. for
  Cholesky (needs SPD matrices).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

import sympy
import torch

from boomfx.kernels_db.schema import KernelKey, canonical_json
from boomfx.passes.costs.registry import OpCall
from boomfx.passes.specs import TensorSpec
from boomfx.passes.op_names import op_from_name, op_name  # noqa: F401  (re-exported: the one codec)

aten = torch.ops.aten


class SymbolicKeyError(ValueError):
    """The call still has symbolic sizes or scalars; bind them before keying."""


class UnkeyableCallError(TypeError):
    """An argument of a type the key cannot represent."""


# ---------------------------------------------------------------------------------------------------------
# Key construction
# ---------------------------------------------------------------------------------------------------------


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    expr = sympy.sympify(value)
    if expr.free_symbols:
        raise SymbolicKeyError(f"{what} is symbolic ({expr}); bind symbols (TensorSpec.subs) before keying")
    return int(expr)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_entry(spec: TensorSpec, arg: str) -> dict:
    return {
        "arg": arg,
        "shape": [_int(s, f"shape of '{arg}'") for s in spec.shape],
        "stride": [_int(s, f"stride of '{arg}'") for s in spec.stride],
        "dtype": _dtype_name(spec.dtype),
        "offset": _int(spec.storage_offset, f"storage offset of '{arg}'"),
    }


def _canon(value: Any, path: str, tensors: list[dict]) -> Any:
    """One argument value in canonical JSON form; tensors are appended to ``tensors`` and left as slots."""
    if isinstance(value, TensorSpec):
        tensors.append(_tensor_entry(value, path))
        return {"$t": len(tensors) - 1}
    if isinstance(value, (list, tuple)):
        return [_canon(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, sympy.Basic):
        if value.free_symbols:
            raise SymbolicKeyError(f"argument '{path}' is symbolic ({value}); bind symbols before keying")
        if value in (sympy.true, sympy.false):
            return bool(value)
        if value.is_Integer:
            return int(value)
        return _canon(float(value), path, tensors)
    if isinstance(value, torch.dtype):
        return {"$dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": None}
    if isinstance(value, torch.layout):
        return {"$layout": str(value)}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value)}
    raise UnkeyableCallError(
        f"argument '{path}' of type {type(value).__name__} cannot be part of a kernel key"
    )


def kernel_key(call: OpCall) -> KernelKey:
    """The canonical key of ``call``; raises ``SymbolicKeyError`` if any size is still symbolic."""
    tensors: list[dict] = []
    args = {name: _canon(value, name, tensors) for name, value in call.args.items()}
    context = {
        name: _canon(value, f"context.{name}", tensors) for name, value in sorted(call.context.items())
    }
    name = op_name(call.op)
    data = {"op": name, "args": args, "tensors": tensors, "context": context}
    dtype = tensors[0]["dtype"] if tensors else "none"
    return KernelKey(name, dtype, canonical_json(data))


def replace_tensors(key: KernelKey, fn: Callable[[dict], dict]) -> KernelKey:
    """A key with every tensor entry passed through ``fn`` (args and context unchanged)."""
    data = key.data
    data["tensors"] = [fn(dict(t)) for t in data["tensors"]]
    return KernelKey(key.op, key.dtype, canonical_json(data))


def shrunk_key(key: KernelKey) -> KernelKey:
    """The same call with every tensor of one element per dim (contiguous): what dispatch costs alone."""

    def shrink(t: dict) -> dict:
        t.update(shape=[1] * len(t["shape"]), stride=[1] * len(t["shape"]), offset=0)
        return t

    return replace_tensors(key, shrink)


# ---------------------------------------------------------------------------------------------------------
# Valid ranges of integer tensors, by op (rules keyed by op packet objects, never by strings)
# ---------------------------------------------------------------------------------------------------------

IndexBound = Callable[[dict, dict], Optional[int]]  # (args with tensors resolved to entries, tensor entry)


def _dim_size(entry: dict, dim: int) -> int:
    return entry["shape"][dim % max(len(entry["shape"]), 1)] if entry["shape"] else 1


def _bound_dim_of_self(args: dict, t: dict) -> Optional[int]:
    return _dim_size(args["self"], int(args.get("dim") or 0)) if isinstance(args.get("self"), dict) else None


def _bound_embedding(args: dict, t: dict) -> Optional[int]:
    return args["weight"]["shape"][0] if t["arg"] == "indices" else None


def _bound_num_weights(args: dict, t: dict) -> Optional[int]:
    return int(args["num_weights"]) if t["arg"] == "indices" else None


def _bound_classes(args: dict, t: dict) -> Optional[int]:
    if t["arg"] != "target":
        return None
    shape = args["self"]["shape"]
    return shape[1] if len(shape) >= 2 else shape[0]


def _bound_advanced_index(args: dict, t: dict) -> Optional[int]:
    if not t["arg"].startswith("indices["):
        return None
    position = int(t["arg"][len("indices[") : -1])
    return _dim_size(args["self"], position)


def _packets(*names: str) -> list:
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


INDEX_BOUNDS: dict[Any, IndexBound] = {}
for _p in _packets("embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"):
    INDEX_BOUNDS[_p] = _bound_embedding
for _p in _packets("embedding_dense_backward", "embedding_backward"):
    INDEX_BOUNDS[_p] = _bound_num_weights
for _p in _packets(
    "gather",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "index_select",
    "index_add",
    "index_add_",
    "index_copy",
    "index_copy_",
    "index_fill",
    "index_fill_",
):
    INDEX_BOUNDS[_p] = _bound_dim_of_self
for _p in _packets(
    "nll_loss_forward", "nll_loss2d_forward", "nll_loss_backward", "nll_loss2d_backward", "nll_loss"
):
    INDEX_BOUNDS[_p] = _bound_classes
for _p in _packets(
    "index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"
):
    INDEX_BOUNDS[_p] = _bound_advanced_index


def _grouped_total(a: Any, b: Any) -> Optional[int]:
    """The size a grouped product's groups split (``passes/costs/grouped_mm.py``'s table): the rows of a
    2-D ``a`` against a 3-D ``b`` (MoE tokens), K of 2-D x 2-D, N of 3-D x 2-D."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    ranks = (len(a["shape"]), len(b["shape"]))
    return {(2, 3): a["shape"][0], (2, 2): a["shape"][1], (3, 2): b["shape"][-1]}.get(ranks)


def _balanced_group_offsets(args: dict, t: dict) -> Optional[list[int]]:
    """``offs[g] = (g + 1) * total // G``: every group gets its share of the grouped dimension, ending at
    its size, as a router that spreads tokens evenly over the experts does."""
    if t["arg"] != "offs" or len(t["shape"]) != 1:
        return None
    a = args.get("self", args.get("input"))
    total = _grouped_total(a, args.get("mat2", args.get("weight")))
    if total is None:
        return None
    groups = t["shape"][0]
    return [(g + 1) * total // groups for g in range(groups)]


def _bag_offsets(args: dict, t: dict) -> Optional[list[int]]:
    """``embedding_bag``'s ``offsets``: bag starts, the first 0 (the op refuses anything else), the indices
    split evenly over the bags; with ``include_last_offset`` the last entry is the number of indices."""
    indices = args.get("indices")
    if t["arg"] != "offsets" or len(t["shape"]) != 1 or not isinstance(indices, dict):
        return None
    total = math.prod(indices["shape"])
    count = t["shape"][0]
    bags = count - 1 if args.get("include_last_offset") else count
    return [min(b, bags) * total // max(bags, 1) for b in range(count)]


IntValues = Callable[[dict, dict], Optional[list[int]]]   # (resolved args, tensor entry) -> flat values
# integer tensors that hold a structure, not indices; keyed by the op's packet name as keys spell it
INT_VALUES: dict[str, IntValues] = {name: _balanced_group_offsets for name in (
    "aten._grouped_mm", "aten._scaled_grouped_mm",
    "transformers.grouped_mm_fallback", "transformers.grouped_mm_fallback_backward")}
INT_VALUES.update({name: _bag_offsets for name in (
    "aten.embedding_bag", "aten._embedding_bag", "aten._embedding_bag_forward_only", "aten._embedding_bag_backward",
    "aten._embedding_bag_dense_backward", "aten._embedding_bag_per_sample_weights_backward")})


def int_values(data: dict, entry: dict) -> Optional[list[int]]:
    """The values integer tensor ``entry`` must hold for the call to do its real work (None: any index)."""
    rule = INT_VALUES.get(data["op"].rsplit(".", 1)[0])
    if rule is None:
        return None
    return rule({k: _resolve(v, data["tensors"]) for k, v in data["args"].items()}, entry)


def _resolve(value: Any, tensors: list[dict]) -> Any:
    if isinstance(value, dict) and "$t" in value:
        return tensors[value["$t"]]
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    return value


def int_upper_bound(op: torch._ops.OpOverload, data: dict, entry: dict) -> int:
    """Exclusive upper bound for the values of integer tensor ``entry`` of the call in ``data``."""
    args = {k: _resolve(v, data["tensors"]) for k, v in data["args"].items()}
    rule = INDEX_BOUNDS.get(op.overloadpacket)
    bound = rule(args, entry) if rule is not None else None
    if bound is None:  # any dim of any other tensor: always a valid index, whatever it indexes
        dims = [s for t in data["tensors"] if t is not entry for s in t["shape"] if s > 0]
        bound = min(dims) if dims else 2
    return max(int(bound), 1)


# ---------------------------------------------------------------------------------------------------------
# Real inputs
# ---------------------------------------------------------------------------------------------------------


def _storage_numel(entry: dict) -> int:
    if any(s == 0 for s in entry["shape"]):
        return entry["offset"]
    return entry["offset"] + sum((s - 1) * abs(st) for s, st in zip(entry["shape"], entry["stride"])) + 1


def input_bytes(key: KernelKey) -> int:
    """The bytes ``make_inputs`` allocates for ``key`` (each tensor's whole storage), known before building."""
    return sum(max(_storage_numel(e), 1) * getattr(torch, e["dtype"]).itemsize for e in key.data["tensors"])


def make_tensor(
    op: torch._ops.OpOverload, data: dict, entry: dict, device: torch.device, generator: torch.Generator
) -> torch.Tensor:
    """A random tensor with the entry's shape, strides, offset and dtype, filled over its whole storage."""
    dtype = getattr(torch, entry["dtype"])
    numel = max(_storage_numel(entry), 1)
    where = generator.device  # generate on the target device: no host copy of large inputs
    if dtype == torch.bool:
        base = torch.randint(0, 2, (numel,), generator=generator, device=where).to(
            device=device, dtype=torch.bool
        )
    elif dtype.is_floating_point or dtype.is_complex:
        base = (torch.rand(numel, generator=generator, device=where) * 0.5 + 0.25).to(
            device=device, dtype=dtype
        )
    elif (values := int_values(data, entry)) is not None:
        base = torch.zeros(numel, dtype=dtype, device=device)
        base.as_strided(entry["shape"], entry["stride"], entry["offset"]).copy_(
            torch.tensor(values, dtype=dtype).reshape(entry["shape"]))
    else:
        high = int_upper_bound(op, data, entry)
        base = torch.randint(0, high, (numel,), generator=generator, device=where).to(
            device=device, dtype=dtype
        )
    return base.as_strided(entry["shape"], entry["stride"], entry["offset"])


def _materialise(value: Any, tensors: list[torch.Tensor], device: torch.device) -> Any:
    if isinstance(value, list):
        return [_materialise(v, tensors, device) for v in value]
    if isinstance(value, dict):
        if "$t" in value:
            return tensors[value["$t"]]
        if "$dtype" in value:
            return getattr(torch, value["$dtype"])
        if "$device" in value:
            return device
        if "$layout" in value:
            return getattr(torch, value["$layout"].removeprefix("torch."))
        if "$memory_format" in value:
            return getattr(torch, value["$memory_format"].removeprefix("torch."))
        if "$float" in value:
            return float(value["$float"])
    return value


def make_inputs(
    key: KernelKey, device: torch.device, seed: int = 0
) -> tuple[torch._ops.OpOverload, list, dict]:
    """``(op, args, kwargs)`` to run the keyed call for real on ``device``.

    Positional/keyword split follows the op's schema, so ``op(*args, **kwargs)`` is the call.
    """
    data = key.data
    op = op_from_name(data["op"])
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    tensors = [make_tensor(op, data, entry, device, gen) for entry in data["tensors"]]
    args: list = []
    kwargs: dict = {}
    for a in op._schema.arguments:
        if a.name not in data["args"]:
            continue
        value = _materialise(data["args"][a.name], tensors, device)
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return op, args, kwargs


def key_tensors(key: KernelKey) -> list[dict]:
    return key.data["tensors"]


def key_args(key: KernelKey) -> Mapping[str, Any]:
    return key.data["args"]
