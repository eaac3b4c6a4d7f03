"""The one string form of an operator: ``"aten.mm.default"`` (namespace.packet.overload), as the kernel
database stores it and fused-kernel descriptions record it; ``"getitem"`` names ``operator.getitem``."""
from __future__ import annotations

import operator
from typing import Any

import torch

GETITEM = "getitem"


def op_name(op: Any) -> str:
    """'aten.mm.default' for an OpOverload; 'getitem' for ``operator.getitem``."""
    if op is operator.getitem:
        return GETITEM
    return f"{op.namespace}.{op._schema.name.split('::')[-1]}.{op._overloadname}"


def op_from_name(name: str) -> Any:
    """The inverse of ``op_name``."""
    if name == GETITEM:
        return operator.getitem
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
