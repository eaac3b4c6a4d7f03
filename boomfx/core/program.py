"""``Program``: the captured graph plus its symbols, the plain value handed from capture to the passes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import sympy
import torch.fx

from boomfx.core.fx_copy import copy_graph
from boomfx.core.losses import LOSSES

# ``Program.derived`` key of a compiled program's eager program (the capture before ``compile_program``):
# per-rank rewrites (boomfx/distributed/ranks.py) start from it and compile each rank's program
EAGER_PROGRAM = "eager program"

# Placeholder roles (what an input of the graph is); liveness maps them to memory categories.
ROLE_PARAM = "param"
ROLE_BUFFER = "buffer"
ROLE_INPUT = "input"
ROLE_LABEL = "label"
ROLE_OPT_STATE = "opt_state"
ROLE_CONSTANT = "constant"
ROLE_GRAD = "grad"

# Node phases; inference programs are all forward.
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_OPTIMIZER = "optimizer"
PHASE_RECOMPUTE = "recompute"
# Node meta flag: the op runs eagerly, outside the compiled graphs of its phase (the autograd engine's
# AccumulateGrad copy of a gradient that came out in another layout): one kernel, never fused.
META_EAGER = "boomfx.eager"
# GraphModule meta: node name -> names of nodes it also keeps alive (a runtime frees them there, not at
# their last use: FSDP's reshard after forward; boomfx/distributed/fsdp.py)
META_RUNTIME_USES = "boomfx.runtime_uses"
# Node meta: on an FSDP unit's post-backward ``_chunk_cat`` (boomfx/distributed/fsdp.py), the unit's parameter
# count: FSDP2's hooks for that unit run once a step (their host work: kernels_db/framework_overheads.py)
META_FSDP_UNIT = "boomfx.fsdp_unit"
# Node meta: on the all-reduce DTensor issues for a tensor-parallel linear (boomfx/distributed/tp_ops.py): one
# parallel linear's DTensor host work (its forward, backward and parameters' optimizer step)
META_TP_LINEAR = "boomfx.tp_linear"
# Node meta: a kernel or view ATen's C++ issues in a loop of its own (a recurrent layer's per-step cell ops,
# boomfx/training/recurrent.py): no Python between them, so none of eager Python's per-op host costs
META_NATIVE_LOOP = "boomfx.native_loop"
# Node meta: per output of a compiled kernel, the (node name, output index) whose storage Inductor's wrapper
# hands it from its pool of dead buffers (passes/buffer_reuse.py), or None for a fresh allocation
META_BUFFER_REUSE = "boomfx.buffer_reuse"
# Node meta: on a compiled ``cat`` (Inductor's ConcatKernel), (input position, kernel node name, output index)
# of each input its kernel writes straight into the concat buffer (passes/concat_into.py): no storage of its own
META_CONCAT_INTO = "boomfx.concat_into"
# Node meta: the pipeline schedule action (kind, micro-batch, virtual stage) a stage program's node runs in
# (boomfx/distributed/pipeline_stages.py); none: once a step. Each action is its own call of the compiled
# regions, so no fusion joins nodes of two actions (passes/fusion.py).
META_ACTION = "boomfx.pp_action"


@dataclass(frozen=True)
class SymbolInfo:
    """One symbolic dimension: its sympy symbol, exported range, and what it is (batch, seq) if known."""

    symbol: sympy.Symbol
    min_value: int
    max_value: Optional[int]           # None: unbounded above
    hint: Optional[int] = None         # the example size seen at export
    role: Optional[str] = None         # "batch" | "seq" | None
    # other names --dim accepts: the export's Dim names, then "<input>.<dim>" (boomfx/frontend/symbol_names.py)
    names: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return str(self.symbol)

    def describe(self) -> str:
        hi = "inf" if self.max_value is None else str(self.max_value)
        aka = ([self.role] if self.role else []) + [n for n in self.names if n != self.role]
        return f"{self.name}{' (' + ', '.join(aka) + ')' if aka else ''} in [{self.min_value}, {hi}]"


@dataclass(frozen=True)
class ProgramOptions:
    train: bool = False
    optimizer: str = "adamw"
    amp: Optional[str] = None
    checkpoint: bool = False
    target_kind: str = "cuda"      # "cuda": GPU kernels (fused attention); "cpu": the host's own kernels
    compile: bool = False        # predict torch.compile (Inductor): see passes/compiled.py
    cudagraphs: bool = False     # with compile: mode="reduce-overhead" (CUDA graph replay)
    # selective activation checkpointing: only these instances of the main layer list ("h.0",
    # "model.layers.3"); when non-empty it wins over ``checkpoint`` (which means every instance)
    checkpoint_layers: tuple[str, ...] = ()
    # with train: every .grad stays allocated between steps (zero_grad(set_to_none=False), gradient
    # accumulation) instead of PyTorch's default set_to_none=True (allocated in backward, freed after the step)
    resident_grads: bool = False
    # with train: the parameters compute in this dtype ("bfloat16"), no autocast: FSDP2's
    # MixedPrecisionPolicy(param_dtype=...); set by the FSDP rewrite's re-trace (boomfx/distributed)
    param_dtype: Optional[str] = None
    # with train: how the step reduces the model's output to a loss (training/trace.py ``_loss_of``):
    # "auto", "cross_entropy", "mean" or "output"
    loss: str = "auto"
    # with train: how torch.optim steps, as torch.optim picks by default (``_default_to_fused_or_foreach``)
    # when None: foreach (``torch._foreach_*`` over every parameter at once, temporaries the size of all
    # parameters) on a CUDA target, its per-parameter loop (one parameter's temporaries at a time) on a CPU.
    # True/False force foreach/the loop. The loop's small ops are priced as they run in the step, each
    # reading the tensors the op before it just touched (kernels_db/in_step.py's operand flow)
    foreach: Optional[bool] = None
    # as the nn.Module runs eagerly: in inference tensors bound to Python locals of the model's forward live until
    # rebound or returned (passes/python_locals.py), and on a CPU transformers' experts call torch's grouped
    # matmul rather than the fallback the export traced (passes/eager_grouped_mm.py); in inference and training
    # (not compiled) transformers' attention calls SDPA causal without the export's mask and repeated KV heads
    # (passes/eager_sdpa.py, ``traces_eager_attention`` for re-traced steps); False: freed at last use,
    # the export's own ops, as the export's graph (``ep.module()``) runs, which is what ``boomfx validate`` measures
    # (with the grouped-product rewrite on a CPU applied to both its sides: boomfx/validate/run.py)
    python_locals: bool = True
    # with train: the main layer stack synthesised at this many layers (>= 4) instead of the export's: a
    # search's depth probes (boomfx/distributed/depth_probe.py). Only where the step is synthesised from a
    # truncated trace (boomfx/training/truncate.py); a step traced whole keeps the export's depth, so a
    # caller reads the program's layer count rather than trusting this
    stack_depth: Optional[int] = None

    @property
    def runs_eager_module(self) -> bool:
        """Whether the program is priced as the nn.Module runs eagerly rather than as the export's graph runs
        (eager inference with ``python_locals``): its Python locals held (passes/python_locals.py), the library
        ops it calls eagerly (passes/eager_grouped_mm.py)."""
        return self.python_locals and not self.train and not self.compile

    @property
    def uses_foreach(self) -> bool:
        """Whether the traced optimizer step is foreach: ``foreach`` when given, else torch.optim's default
        for the target's tensors (foreach on CUDA, the per-parameter loop on a CPU)."""
        return self.foreach if self.foreach is not None else self.target_kind != "cpu"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            from boomfx.core.errors import OptionError
            raise OptionError(f"unknown loss {self.loss!r}: one of {', '.join(LOSSES)}")
        # lists/one string from the API become a tuple, so options stay hashable
        layers = self.checkpoint_layers
        if isinstance(layers, str):
            layers = [p for p in layers.split(",") if p.strip()]
        object.__setattr__(self, "checkpoint_layers", tuple(str(p).strip() for p in (layers or ())))


@dataclass(frozen=True)
class Program:
    """An fx graph on fake tensors with symbolic sizes, and everything the passes need to know about it.

    ``input_roles`` maps placeholder names to roles; ``phases`` maps call nodes to forward/backward/
    optimizer/recompute; ``grad_nodes`` maps nodes producing a parameter gradient to its FQN.
    """

    gm: torch.fx.GraphModule
    symbols: Mapping[str, SymbolInfo]
    input_roles: Mapping[str, str]
    options: ProgramOptions = ProgramOptions()
    phases: Mapping[str, str] = field(default_factory=dict)
    grad_nodes: Mapping[str, str] = field(default_factory=dict)
    param_names: Mapping[str, str] = field(default_factory=dict)
    source: str = "<memory>"
    warnings: tuple[str, ...] = ()      # known approximations of this capture, copied into the Report
    # the ExportedProgram a training program was traced from (a per-rank rewrite re-traces it: tensor
    # parallelism); held by the program, not by a process-wide table, so it dies with it. None after a rewrite
    export: Any = field(default=None, compare=False, repr=False)
    # programs rewritten from this one, kept by the rewrite's key so that plans sharing it build it once
    # (boomfx/distributed/tensor_parallel.py); they die with this program. Empty after a rewrite
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    def symbol(self, name_or_role: str) -> SymbolInfo:
        """By symbol (``s77``), then by a name of ``SymbolInfo.names``, then by role (``batch``)."""
        if name_or_role in self.symbols:
            return self.symbols[name_or_role]
        for info in self.symbols.values():
            if name_or_role in info.names:
                return info
        for info in self.symbols.values():
            if info.role == name_or_role:
                return info
        raise KeyError(name_or_role)

    def phase_of(self, node: torch.fx.Node) -> str:
        return self.phases.get(node.name, PHASE_FORWARD)

    def runs_eagerly(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` runs outside torch.compile's graphs: the optimizer step (``torch.compile(model)``
        leaves it eager) and nodes flagged ``META_EAGER``."""
        return self.phase_of(node) == PHASE_OPTIMIZER or bool(node.meta.get(META_EAGER))

    def copied_graph(self) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node]]:
        """A copy of the graph to rewrite (node names kept) and the map from this graph's nodes to it."""
        graph = torch.fx.Graph()
        val_map: dict[torch.fx.Node, torch.fx.Node] = {}
        graph.output(copy_graph(graph, self.graph, val_map))
        return graph, val_map

    def rewritten(self, graph: torch.fx.Graph, **changes: object) -> "Program":
        """This program with ``graph`` (checked) in place of its own, and any other fields ``changes``
        (the rewrites of passes/compiled.py, layout.py, post_grad.py end here)."""
        from dataclasses import replace

        from torch.fx._lazy_graph_module import _LazyGraphModule
        graph.lint()
        # lazy: Python code is generated on the first call or ``.code``, which the analysis never needs (fx's
        # code generation was half of an 80-layer rank rewrite; frontend/deserialize.py does the same)
        gm = _LazyGraphModule(self.gm, graph)
        gm.meta.update(self.gm.meta)
        changes.setdefault("export", None)
        changes.setdefault("derived", {})
        return replace(self, gm=gm, **changes)
