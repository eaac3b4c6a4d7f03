"""Shapes/costs pass: per node, its OpCall (symbolic shapes) and its Cost from the formula registry.

Nodes that launch no kernel (views, bookkeeping) cost nothing by construction; every kernel gets a
cost, from its formula or — flagged unmodelled — from the bytes it moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch.fx

import torch

from boomfx.passes.aliasing import MAYBE_COPY_OPS
from boomfx.passes.costs.registry import OpCall, PricedCall, price_call
from boomfx.passes.errors import node_error
from boomfx.passes.kernels import kernel_pass
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.opcall import opcall_from_node
from boomfx.core.program import Program

aten = torch.ops.aten


@dataclass(frozen=True)
class NodeCost:
    call: OpCall
    priced: PricedCall


@dataclass(frozen=True)
class CostInfo:
    by_node: Mapping[str, NodeCost]

    def get(self, node: torch.fx.Node) -> Optional[NodeCost]:
        return self.by_node.get(node.name)

    def unmodelled_ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for nc in self.by_node.values():
            if not nc.priced.modelled:
                key = str(nc.call.op)
                counts[key] = counts.get(key, 0) + 1
        return counts


def cost_pass(program: Program, am: AnalysisManager) -> CostInfo:
    kernels = am.get(kernel_pass)
    reps: dict[str, str] = {}
    if am.reuse_blocks:
        from boomfx.passes.blocks import block_pass, representatives
        reps = representatives(am.get(block_pass))
    by_node: dict[str, NodeCost] = {}
    nodes = {node.name: node for node in program.graph.nodes}

    def compute(node: torch.fx.Node, choice: object) -> NodeCost:
        if getattr(node.target, "boomfx_fused", False):  # compiled execution: the FusedKernel's own Cost
            return NodeCost(node.target.opcall(), PricedCall(node.target.cost, True))
        try:
            context = {"sdpa_backend": choice.sdpa_backend} if choice.sdpa_backend else {}
            call = opcall_from_node(node, context)
            if call is None:
                return None
            if node.target in MAYBE_COPY_OPS:
                # reshape/contiguous/to that materialise a copy here run the clone kernel
                call = OpCall.build(aten.clone.default, (call.tensor_args()[0],), {}, call.outputs, context)
            return NodeCost(call, price_call(call, am.registry))
        except Exception as exc:  # a formula bug must name the node it failed on
            raise node_error("cost pass", node, exc) from exc

    for node in program.graph.nodes:
        choice = kernels.by_node.get(node.name)
        if choice is None or not choice.launches:
            continue
        rep = reps.get(node.name)
        if rep is not None:     # same op and symbolic shapes as its counterpart in instance 0
            if rep not in by_node:
                by_node[rep] = compute(nodes[rep], kernels.by_node[rep])
            by_node[node.name] = by_node[rep]
        else:
            by_node[node.name] = compute(node, choice)
    return CostInfo({k: v for k, v in by_node.items() if v is not None})
