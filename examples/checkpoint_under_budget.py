"""Choose which layers to checkpoint for a memory budget with the annotate pass, then verify it.

Steps:
1. ``boomfx.annotate(model, x, train=True)`` predicts a training step and writes each node's
   numbers into ``node.meta["boomfx"]``; the forward storages a backward node reads are in the
   "activation" category, so summing ``alloc_bytes`` of those nodes per layer gives the bytes each
   layer keeps alive for the backward pass.
2. Greedily pick layers, largest activations first, until the predicted peak minus what they hold
   fits the budget (an estimate: recomputation brings back one layer's activations at a time).
3. Re-analyse with exactly that selection (``boomfx.analyze(..., checkpoint_layers=[...])``, the CLI's
   ``--checkpoint-layers``); while the predicted peak is still over budget, add the next layer and
   re-analyse. Report the predicted peak before and after.

Run::

    python examples/checkpoint_under_budget.py --budget-fraction 0.8 --device a100-80gb
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import boomfx
from boomfx.core.layers import layer_of
from boomfx.core.units import fmt_bytes


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPStack(torch.nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def peak_bytes(report: boomfx.Report) -> int:
    """Peak allocated bytes (the allocator model's), or peak live bytes on a CPU device."""
    alloc = report.memory.allocator
    return alloc.peak_allocated_bytes if alloc is not None else report.memory.peak_live_bytes


def activation_bytes_by_layer(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Bytes of activations (forward storages kept for backward) created in each layer."""
    by_layer: dict[str, int] = {}
    for node in gm.graph.nodes:
        info = node.meta["boomfx"]
        if info["category"] == "activation" and info["module"]:
            layer = layer_of(info["module"])
            by_layer[layer] = by_layer.get(layer, 0) + info["alloc_bytes"]
    return by_layer


@dataclass(frozen=True)
class Plan:
    budget_bytes: int
    peak_before_bytes: int
    activations_by_layer: dict[str, int]
    chosen_layers: list[str]            # the layers checkpointed in the re-analysis (greedy order)
    estimated_peak_bytes: int           # before minus the estimate's layers' activations
    peak_after_bytes: int               # re-analysed with checkpoint_layers=chosen_layers, or = before
    analyses: int = 1                   # predictions made (the annotate pass included)

    @property
    def fits(self) -> bool:
        return self.peak_after_bytes <= self.budget_bytes


def plan_checkpointing(model: torch.nn.Module, *inputs: torch.Tensor, budget_bytes: int,
                       device: str = "a100-80gb", optimizer: str = "sgd") -> Plan:
    before = boomfx.annotate(model, *inputs, device=device, train=True, optimizer=optimizer)
    peak_before = peak_bytes(before.report)
    acts = {k: v for k, v in activation_bytes_by_layer(before.gm).items() if k != "(top level)"}
    order = sorted(acts, key=lambda layer: -acts[layer])     # stable: ties keep graph order
    chosen: list[str] = []
    estimate = peak_before
    for layer in order:
        if estimate <= budget_bytes:
            break
        chosen.append(layer)
        estimate -= acts[layer]
    peak_after, analyses = peak_before, 1
    while chosen:   # verify the estimate with the prediction; one more layer while still over budget
        after = boomfx.analyze(model, *inputs, device=device, train=True, optimizer=optimizer,
                               checkpoint_layers=chosen)
        peak_after, analyses = peak_bytes(after), analyses + 1
        if peak_after <= budget_bytes or len(chosen) == len(order):
            break
        chosen.append(order[len(chosen)])
    return Plan(budget_bytes, peak_before, acts, chosen, estimate, peak_after, analyses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100-80gb")
    parser.add_argument("--budget-fraction", type=float, default=0.8,
                        help="budget as a fraction of the predicted peak without checkpointing")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    model, x = MLPStack(), torch.randn(args.batch, args.seq, 64)
    baseline = boomfx.analyze(model, x, device=args.device, train=True, optimizer="sgd")
    budget = int(peak_bytes(baseline) * args.budget_fraction)
    plan = plan_checkpointing(model, x, budget_bytes=budget, device=args.device)
    print(f"budget:                 {fmt_bytes(plan.budget_bytes)}")
    print(f"peak without checkpoint: {fmt_bytes(plan.peak_before_bytes)}")
    for layer, nbytes in sorted(plan.activations_by_layer.items()):
        mark = "checkpoint" if layer in plan.chosen_layers else ""
        print(f"  {layer:<12} activations {fmt_bytes(nbytes):>10}  {mark}")
    print(f"greedy plan: {len(plan.chosen_layers)} of {len(plan.activations_by_layer)} layers "
          f"({', '.join(plan.chosen_layers) or 'none'}), "
          f"estimated peak {fmt_bytes(plan.estimated_peak_bytes)}")
    print(f"peak with checkpoint_layers={plan.chosen_layers}: {fmt_bytes(plan.peak_after_bytes)} "
          f"(before {fmt_bytes(plan.peak_before_bytes)}, {plan.analyses} predictions) "
          f"-> {'fits' if plan.fits else 'does NOT fit'} the budget")


if __name__ == "__main__":
    main()
