"""The annotate pass: write boomfx's per-node prediction into ``node.meta["boomfx"]``.

For compiler pipelines that want the prediction *on the graph* rather than in a Report: every node
of the analysed graph (placeholders, views, getitems and the output included) gets a plain dict
under ``META_KEY``, and the Report of the same evaluation comes back alongside, so per-node values
add up to the Report's totals.

Which graph gets annotated:
    - a GraphModule that is already aten-level with fake values on its nodes (``make_fx``, AOT
      autograd, ``ExportedProgram.graph_module``): its own nodes, in place (the same Node objects);
    - an ExportedProgram (inference): ``ep.graph_module``, in place;
    - an nn.Module + inputs, a .pt2 path, or a torch-level GraphModule: the exported graph, which is
      returned (``result.gm``);
    - ``train=True`` / ``amp=...``: the traced training/autocast graph (a new GraphModule), returned.

Fields of ``node.meta["boomfx"]`` (units in the names):
    is_kernel (bool), op (str or None), phase, module, flops, bytes_read, bytes_written,
    time_ns, host_ns, start_ns (simulated start of the kernel on its stream), source (where the time
    came from: "measured" ... "roofline"; "none" for nodes that launch no kernel), modelled (a cost
    formula, not the bytes-moved fallback, priced it), workspace_bytes, alloc_bytes (bytes of the
    storages the node creates), category (memory category of the first storage it creates, or
    None), freed_bytes (storages whose last use is this node), live_bytes (storage bytes live while
    the node runs: its inputs, its outputs and everything else alive), live_bytes_after (live once
    it has run and its dead inputs are freed).

Example::

    >>> gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(x)
    >>> result = boomfx.annotate(gm, device="a100-80gb")
    >>> gm.graph.find_nodes(op="call_function")[0].meta["boomfx"]["time_ns"]
    >>> result.report.time.total_ns

Known limitations:
    - Numbers are for one binding of the symbols; annotate again to re-bind (the symbolic passes are
      not cached across calls).
    - Nodes that launch no kernel report zero time and no source, even when a later kernel's cost
      includes the copy a view makes unavoidable.
    - ``live_bytes`` is the liveness timeline (storages only, no allocator rounding or caching); the
      allocator's view is in ``result.report.memory.allocator``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import sympy
import torch
import torch.fx

from boomfx.analysis.analysis import Analysis, AnalyzeOptions, PointResult
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import DimError
from boomfx.core.layers import module_path
from boomfx.core.program import Program, ProgramOptions
from boomfx.report.model import Report

META_KEY = "boomfx"
NO_SOURCE = "none"


@dataclass(frozen=True)
class AnnotateResult:
    """What ``annotate`` returns: the annotated graph, its Report, and the binding used.

    ``gm`` is the graph whose nodes carry ``meta["boomfx"]`` (the input GraphModule itself when it was
    annotated in place). ``annotations`` maps node names to the same dicts.
    """

    gm: torch.fx.GraphModule
    report: Report
    bindings: Mapping[str, int]
    annotations: Mapping[str, Mapping[str, Any]]
    program: Program
    analysis: Analysis

    def __getitem__(self, node_name: str) -> Mapping[str, Any]:
        return self.annotations[node_name]


def bind_symbols(program: Program, bindings: Optional[Mapping[Any, int]], dims: Optional[Mapping[str, int]],
              batch: Optional[int], seq: Optional[int]) -> dict[sympy.Symbol, int]:
    """Bind by symbol, by name/role, then --batch/--seq; symbols still unbound take their example hint."""
    by_name: dict[str, int] = dict(dims or {})
    explicit: dict[sympy.Symbol, int] = {}
    for key, value in (bindings or {}).items():
        if isinstance(key, sympy.Symbol):
            explicit[key] = int(value)
        else:
            by_name[str(key)] = int(value)
    out = resolve_bindings(program, by_name, batch, seq, allow_unbound=True)
    out.update(explicit)
    missing = []
    for info in program.symbols.values():
        if info.symbol in out:
            continue
        if info.hint is None:
            missing.append(info.describe())
        else:
            out[info.symbol] = int(info.hint)
    if missing:
        raise DimError(f"unbound symbolic dimension(s) with no example size: {'; '.join(missing)}; "
                       "pass dims={name: value}")
    return out


def annotate(source: Any, *example_inputs: Any, device: Union[str, DeviceSpec] = "a100-80gb",
             bindings: Optional[Mapping[Any, int]] = None, dims: Optional[Mapping[str, int]] = None,
             batch: Optional[int] = None, seq: Optional[int] = None, train: bool = False,
             optimizer: str = "adamw", amp: Optional[str] = None, checkpoint: bool = False,
             alloc_conf: str = "", outside_memory: str = "", db: Optional[str] = None,
             from_db: Optional[str] = None, checkpoint_layers: Sequence[str] = (), loss: str = "auto") -> AnnotateResult:
    """Predict one step of ``source`` and write each node's share into ``node.meta["boomfx"]``.

    Args:
        source: an aten-level GraphModule with fake values (annotated in place), a torch-level
            GraphModule (exported first, needs ``example_inputs``), an ExportedProgram, an nn.Module
            with ``example_inputs``, a .pt2 path, or a boomfx ``Program``.
        device: target device name (see ``boomfx devices``) or a ``DeviceSpec``.
        bindings: symbol -> size (sympy symbols or their names); ``dims``: name or role -> size;
            ``batch``/``seq``: the symbols identified as batch/sequence. Unbound symbols take the
            example size seen when the graph was traced.
        train, optimizer, amp, checkpoint, checkpoint_layers, loss, alloc_conf, outside_memory, db,
            from_db: as for ``boomfx.analyze`` (``checkpoint_layers=["h.0"]``: checkpoint only those
            layer instances).

    Returns:
        ``AnnotateResult`` with the annotated ``gm``, the ``report`` and the per-node dicts.

    Example::

        >>> result = boomfx.annotate(model, x, device="h100", train=True, optimizer="sgd")
        >>> top = max(result.gm.graph.nodes, key=lambda n: n.meta["boomfx"]["time_ns"])
    """
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    if isinstance(source, Program):
        program = source
    else:
        program = capture(source, *example_inputs, options=ProgramOptions(
            train, optimizer, amp, checkpoint, checkpoint_layers=checkpoint_layers, loss=loss))
    analysis = Analysis(program, spec, AnalyzeOptions(spec.name, alloc_conf, outside_memory, db, from_db))
    bound = bind_symbols(program, bindings, dims, batch, seq)
    point = analysis.evaluate(bound)
    annotations = annotate_nodes(analysis, bound, point)
    return AnnotateResult(program.gm, point.report, {str(s): v for s, v in bound.items()}, annotations,
                          program, analysis)


def annotate_nodes(analysis: Analysis, bindings: Mapping[sympy.Symbol, int],
                   point: PointResult) -> dict[str, dict[str, Any]]:
    """Write ``meta[META_KEY]`` on every node of ``analysis.program``'s graph from one evaluated point."""
    ev = analysis.evaluator(bindings)
    nodes = list(analysis.program.graph.nodes)
    liveness = analysis.liveness
    live = liveness.timeline(ev)
    last = len(nodes) - 1
    alloc_at = [0] * len(nodes)
    freed_at = [0] * len(nodes)
    category_at: list[Optional[str]] = [None] * len(nodes)
    for iv in liveness.intervals:
        if iv.resident:
            continue
        size = ev(iv.nbytes)
        alloc_at[iv.start_step] += size
        if category_at[iv.start_step] is None:
            category_at[iv.start_step] = iv.category.value
        if iv.end_step < last:      # storages alive at the last step live to the end of the step
            freed_at[iv.end_step] += size
    kernels = {k.node: k for k in point.report.kernels}
    out: dict[str, dict[str, Any]] = {}
    for step, node in enumerate(nodes):
        entry = _node_entry(analysis, node, ev, kernels.get(node.name))
        entry.update(alloc_bytes=alloc_at[step], freed_bytes=freed_at[step], category=category_at[step],
                     live_bytes=live[step], live_bytes_after=live[step] - freed_at[step])
        node.meta[META_KEY] = entry
        out[node.name] = entry
    return out


def _node_entry(analysis: Analysis, node: torch.fx.Node, ev: Any, kernel: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "is_kernel": kernel is not None, "op": str(node.target) if node.op == "call_function" else None,
        "phase": analysis.program.phase_of(node) if node.op == "call_function" else None,
        "module": module_path(node), "flops": 0.0, "bytes_read": 0, "bytes_written": 0, "time_ns": 0.0,
        "host_ns": 0.0, "start_ns": None, "source": NO_SOURCE, "modelled": None, "workspace_bytes": 0,
    }
    nc = analysis.costs.by_node.get(node.name)
    if nc is not None:
        cost = nc.priced.cost
        entry.update(flops=ev.number(cost.flops), bytes_read=ev(cost.bytes_read),
                     bytes_written=ev(cost.bytes_written), modelled=nc.priced.modelled)
    if kernel is not None:
        entry.update(time_ns=kernel.time_ns, host_ns=kernel.host_ns, start_ns=kernel.start_ns,
                     source=_source_name(kernel.source), workspace_bytes=kernel.workspace_bytes)
    return entry


def _source_name(source: Any) -> str:
    """Price sources may be ``str`` enums; store their plain value."""
    return str(getattr(source, "value", source))
