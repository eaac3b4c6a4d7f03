"""Wrap a failure inside a pass with the node it happened at, like the FX Interpreter does."""
from __future__ import annotations

import torch.fx


class PassError(RuntimeError):
    pass


def node_error(pass_name: str, node: torch.fx.Node, exc: BaseException) -> PassError:
    trace = node.meta.get("stack_trace") or ""
    where = trace.strip().splitlines()[-2:] if trace else []
    detail = f" (model code: {' / '.join(s.strip() for s in where)})" if where else ""
    return PassError(f"{pass_name} failed at {node.format_node()}: {exc}{detail}")
