"""Mixture-of-experts products as the eager model runs them: torch's ``_grouped_mm`` where the export holds
``transformers``' fallback.

Why: ``transformers`` chooses its experts' grouped product at run time (``integrations/moe.py``,
``_grouped_mm`` / ``_can_use_grouped_mm``). While tracing with non-bf16 weights (torch.export counts as
compiling) it calls ``transformers::grouped_mm_fallback``, a Python loop of one ``mm`` per expert behind a
custom-op dispatch and an ``offs.tolist()``; the eager model calls torch's ``_grouped_mm`` instead wherever
torch has the kernel (on CPU since torch 2.9). So the export of every fp32 ``transformers`` MoE (Mixtral,
Qwen2-MoE, OLMoE, ...) records an op its eager run never calls. Priced as recorded, the CPU database measured
the Python loop: at a one-token decode of a 4-expert layer, 46 vs 28 us per call with the weights hot, 135 vs
119 us in the step (one thread, this VM; the 4-layer Qwen2-MoE of ``benchmarks/serving_cpu.py``, whose 8
products came to 1.08 vs 0.96 ms of a ~5.3 ms step); with torch's default threads its serving steps' kernels
went from +4% to -7% of the real steps, mean signed over seven alternating runs
(``benchmarks/results/serving_cpu_moe.md``).

For eager inference on a CPU target (``ProgramOptions.runs_eager_module``) each such node is rewritten to
``aten._grouped_mm(input, weight, offs=offs)``: the same operands, output and cost rule
(``passes/costs/grouped_mm.py``), so work, bytes and memory are unchanged and only the measured kernel
differs. ``boomfx validate`` (whose programs keep the graph's frees) applies the same rewrite to the
program it prices and to the export graph its real step runs (``call_native_grouped_mm``), so it measures
what the eager model calls. Left as recorded: ``--no-python-locals`` (the export's graph as
``ep.module()`` runs it), ``--compile`` (dynamo traces the fallback, as the export did), GPU
targets (the GPU model prices both by the same formula) and a torch without the CPU kernel.

Known limitations:
- NB ``--train`` keeps the fallback and its backward op (the step is traced through transformers' autograd
  formula for it), though eager training calls ``_grouped_mm`` for the forward and both gradients too (12
  calls in a 2-layer Mixtral step, torch's profiler): same FLOPs and bytes, the Python loop's host time
  measured in.

Example::

    >>> eager = eager_grouped_products(program)       # doctest: +SKIP
    >>> eager is program                             # no fallback in its graph: the same program
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from boomfx.core.program import Program
from boomfx.passes.costs.grouped_mm import TRANSFORMERS_GROUPED_MM
from boomfx.passes.foreign_ops import library_op_name

NATIVE = torch.ops.aten._grouped_mm.default
# the first torch whose ``_grouped_mm`` has a CPU kernel (transformers: torch <= 2.8 falls back on CPU)
CPU_KERNEL_SINCE = "2.9"


def has_cpu_grouped_mm() -> bool:
    """Whether this torch's eager ``_grouped_mm`` runs on CPU tensors (what transformers checks)."""
    return torch.torch_version.TorchVersion(torch.__version__) >= CPU_KERNEL_SINCE


def eager_grouped_products(program: Program) -> Program:
    """``program`` with every ``transformers::grouped_mm_fallback`` node calling ``aten._grouped_mm``, on a copy
    of its graph (the export's own graph is left as it is), or ``program`` itself when it holds none."""
    if not any(n.op == "call_function" and _is_fallback(n.target) for n in program.graph.nodes):
        return program
    graph, _ = program.copied_graph()
    call_native_grouped_mm(graph)
    return program.rewritten(graph, export=program.export)


def call_native_grouped_mm(graph: torch.fx.Graph) -> int:
    """Rewrite, in place, each fallback call of ``graph`` to ``aten._grouped_mm``; return how many. Shared by the
    priced program (above) and ``boomfx validate``'s real step, which runs the rewritten export graph."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and _is_fallback(node.target):
            inp, weight, offs = _operands(node)
            node.target = NATIVE
            node.args, node.kwargs = (inp, weight), {"offs": offs}
            count += 1
    return count


def _is_fallback(target: Any) -> bool:
    """The registered op or its stand-in (``passes/foreign_ops.py``), by the name the cost rule uses."""
    return isinstance(target, torch._ops.OpOverload) and library_op_name(target) == TRANSFORMERS_GROUPED_MM


def _operands(node: torch.fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, offs) of a fallback call, positional or by name (its schema: input, weight, offs)."""
    names = ("input", "weight", "offs")
    values = list(node.args) + [node.kwargs[n] for n in names[len(node.args):]]
    return values[0], values[1], values[2]
