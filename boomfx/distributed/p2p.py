"""Point-to-point send/recv of pipeline stages as graph nodes (``boomfx_pp.send``, ``boomfx_pp.recv_``).

torch 2.13's ``_c10d_functional`` has no send/recv, so a stage program's transfers are two ops of
boomfx's own namespace, defined on first use (never at import): ``recv_`` writes into a persistent
receive buffer in place (``PipelineStage`` allocates one per micro-batch at its first step) and
returns it; ``send`` reads the tensor it hands to the peer stage. Their cost formulas count those
bytes only (0 FLOPs): the transfer's time is ``pipeline_step``'s send/recv price.
"""

from __future__ import annotations

from typing import Any

import torch

from boomfx.passes.costs.registry import Cost, OpCall, register_cost

NAMESPACE = "boomfx_pp"
_LIB: list[Any] = []


def p2p_ops() -> Any:
    """``torch.ops.boomfx_pp`` with ``send`` and ``recv_`` defined (once per process)."""
    if not _LIB:
        lib = torch.library.Library(NAMESPACE, "DEF")
        lib.define("send(Tensor t, int peer, str group) -> ()")
        lib.define("recv_(Tensor(a!) buffer, int peer, str group) -> Tensor(a!)")
        _LIB.append(lib)
        ops = torch.ops.boomfx_pp
        register_cost(ops.send.default)(_send_cost)
        register_cost(ops.recv_.default)(_recv_cost)
    return torch.ops.boomfx_pp


def _send_cost(call: OpCall) -> Cost:
    """The sent tensor is read once."""
    return Cost(0, call.args["t"].nbytes, 0)


def _recv_cost(call: OpCall) -> Cost:
    """The receive buffer is written once."""
    return Cost(0, 0, call.args["buffer"].nbytes)


def is_p2p(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE
