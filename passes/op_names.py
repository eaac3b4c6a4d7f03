"""The one string form of an operator: ``"aten.mm.default"`` (namespace.packet.overload), as the kernel
database stores it and fused-kernel descriptions record it; ``"getitem"`` names ``operator.getitem``; a stand-in for an unregistered custom op
(``foreign_ops``) is named as the file names it."""
from __future__ import annotations

import operator
from typing import Any

import torch

from boomfx.passes.foreign_ops import foreign_name, foreign_op_by_name, is_foreign

GETITEM = "getitem"


def op_name(op: Any) -> str:
    """'aten.mm.default' for an OpOverload; 'getitem' for ``operator.getitem``."""
    if op is operator.getitem:
        return GETITEM
    if is_foreign(op):
        return foreign_name(op)
    return f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"


def op_from_name(name: str) -> Any:
    """The inverse of ``op_name``."""
    if name == GETITEM:
        return operator.getitem
    namespace, packet, overload = name.split(".")
    stand_in = foreign_op_by_name(name)
    if stand_in is not None and not hasattr(getattr(torch.ops, namespace), packet):
        return stand_in
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
