"""Stand-ins for custom operators a .pt2 file names but this process has not registered.

Why: an export of a ``transformers`` Mixtral calls ``torch.ops.transformers.grouped_mm_fallback``,
an op that exists only once ``transformers.integrations.moe`` is imported. boomfx reads files
without the user's code, so such an op is defined here, under its own namespace ``boomfx_foreign``
(defining it under ``transformers`` would make a later ``import transformers`` fail), with the
schema its calls in the file imply. It is then an ordinary ``OpOverload``: passes read its
schema, the kernel pass counts it as a kernel, and it is priced by the bytes it moves and listed as
unmodelled, as an aten op without a formula is. ``op_names.op_name`` shows its original name.

Assumed (export graphs are functional: a mutating custom op appears wrapped in
``auto_functionalize``): the op returns fresh tensors and mutates nothing.

Its fake kernel raises ``ForeignOpCallError``: the file records each call's output metadata, but the
op's shape rule and backward live in its library, so it cannot be re-run (``--train``, ``--amp``);
except the few ops with public semantics that ``passes/foreign_rules.py`` knows (``transformers``'
grouped-mm fallback), whose stand-ins get that shape rule and backward (``can_rerun``).

Example::

    op = define_foreign_op("transformers::grouped_mm_fallback", "default",
                           "(Tensor input, Tensor weight, Tensor offs) -> Tensor")
    assert foreign_name(op) == "transformers.grouped_mm_fallback.default"
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from boomfx.passes.foreign_rules import RERUN_RULES, RerunRule

FOREIGN_NAMESPACE = "boomfx_foreign"

_LIBRARY: Optional[torch.library.Library] = None
_PACKETS: dict[str, list[str]] = {}                # "ns::op" -> stand-in packet names, oldest first
_OVERLOADS: dict[str, dict[str, str]] = {}         # packet -> overload -> signature
_ORIGINAL: dict[str, str] = {}                     # packet -> "ns.op"
_RERUNNABLE: set[str] = set()                      # "packet.overload" of stand-ins given a rule


class ForeignOpCallError(NotImplementedError):
    """A stand-in op was called: its real implementation is in a library this process lacks."""


def _library() -> torch.library.Library:
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(FOREIGN_NAMESPACE, "FRAGMENT")
    return _LIBRARY


class _ForeignOverload(torch._ops.OpOverload):
    """A stand-in prints as the op the file names, so reports and database keys read as they would with
    the library imported; everything else is the ``OpOverload`` torch built."""

    def __str__(self) -> str:
        return foreign_name(self)

    def __repr__(self) -> str:
        return f"<stand-in for custom op {foreign_name(self)}>"


def _op(packet: str, overload: str) -> torch._ops.OpOverload:
    op = getattr(getattr(getattr(torch.ops, FOREIGN_NAMESPACE), packet), overload)   # torch caches this object
    if type(op) is torch._ops.OpOverload:
        op.__class__ = _ForeignOverload
    return op


def define_foreign_op(qualified: str, overload: str, signature: str) -> torch._ops.OpOverload:
    """The stand-in for ``qualified`` (``"ns::op"``) ``.overload`` with ``signature`` ("(args) -> returns").

    Defined once per process and (name, overload, signature); later calls return the same op. The
    same name and overload with another signature (another version of the library) gets a second
    packet, ``ns__op__v2``.
    """
    packets = _PACKETS.setdefault(qualified, [])
    for packet in packets:
        known = _OVERLOADS[packet].get(overload)
        if known == signature:
            return _op(packet, overload)
        if known is None:
            break
    else:
        namespace, name = qualified.split("::", 1)
        packet = f"{namespace}__{name}" + (f"__v{len(packets) + 1}" if packets else "")
        packets.append(packet)
        _OVERLOADS[packet] = {}
        _ORIGINAL[packet] = f"{namespace}.{name}"
    schema_name = packet if overload == "default" else f"{packet}.{overload}"
    _library().define(f"{schema_name}{signature}")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ForeignOpCallError(f"custom op {qualified} has no implementation in this process")

    rule = RERUN_RULES.get((qualified, overload, signature))
    _library().impl(schema_name, rule.fake if rule is not None else refuse, "Meta")
    _library().impl(schema_name, refuse, "CompositeExplicitAutograd")
    _OVERLOADS[packet][overload] = signature
    op = _op(packet, overload)
    if rule is not None:
        _give_rule(op, rule)
        _RERUNNABLE.add(f"{packet}.{overload}")
    return op


def _give_rule(op: torch._ops.OpOverload, rule: RerunRule) -> None:
    """Autograd for a stand-in with a known backward; without one, its gradient is refused when asked for."""
    if rule.backward is None:
        return
    backward = rule.backward

    def run_backward(ctx: Any, *grads: Any) -> Any:
        return backward(ctx, *grads, define=define_foreign_op)

    torch.library.register_autograd(op, run_backward, setup_context=rule.setup_context, lib=_library())


def can_rerun(op: torch._ops.OpOverload) -> bool:
    """Whether a stand-in has a shape rule (and backward) from ``passes/foreign_rules.py``."""
    return is_foreign(op) and f"{op._schema.name.split('::')[-1]}.{op._overloadname}" in _RERUNNABLE


def is_foreign(op: Any) -> bool:
    """Whether ``op`` is a stand-in defined here."""
    return isinstance(op, torch._ops.OpOverload) and op.namespace == FOREIGN_NAMESPACE


def foreign_name(op: torch._ops.OpOverload) -> str:
    """The op's name in the file: ``"transformers.grouped_mm_fallback.default"``."""
    packet = op._schema.name.split("::")[-1]
    return f"{_ORIGINAL[packet]}.{op._overloadname}"


def library_op_name(op: torch._ops.OpOverload) -> str:
    """``"namespace::op"`` as the file names it: the original name for a stand-in, else the op's own."""
    if is_foreign(op):
        return _ORIGINAL[op._schema.name.split("::")[-1]].replace(".", "::", 1)
    return op._schema.name


def foreign_op_by_name(name: str) -> Optional[torch._ops.OpOverload]:
    """The stand-in whose ``foreign_name`` is ``name``, if one was defined in this process."""
    for packet, overloads in _OVERLOADS.items():
        for overload in overloads:
            if f"{_ORIGINAL[packet]}.{overload}" == name:
                return _op(packet, overload)
    return None
