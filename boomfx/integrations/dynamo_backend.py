"""``torch.compile(model, backend="boomfx")``: predict every graph Dynamo captures, then run it.

For each graph Dynamo hands over, the backend traces it to an aten graph on fake tensors
(``make_fx``, never running real kernels; module paths are kept for the by-module breakdown),
analyses that graph for the target device at the sizes of the example inputs, records the Report,
and returns whatever the delegate backend compiles (eager by default). A graph break gives one
more graph, hence one more record.

Failure to analyse a graph never breaks the user's run: the record holds a warning instead of a
Report, and a ``RuntimeWarning`` is issued.

Example::

    model = torch.compile(model, backend="boomfx", options={"device": "h100", "delegate": "inductor"})
    model(x)
    for rep in boomfx.integrations.dynamo_backend.reports():
        print(rep.source, rep.time.total_ns, rep.memory.total_device_bytes)

    backend = boomfx.integrations.dynamo_backend.make_backend(delegate="aot_eager", device="a100-80gb")
    torch.compile(model, backend=backend)(x)
    backend.records                       # this backend's records only

Options (``options={...}`` of ``torch.compile`` or keywords of ``make_backend``): ``device``,
``delegate`` (a registered backend name or a callable), ``delegate_options`` (passed to the
delegate as ``options=``), ``alloc_conf``, ``outside_memory``, ``db``, ``from_db``.

Known limitations:
    - Each graph is analysed as an inference forward at the example sizes (symbolic sizes of a
      ``dynamic=True`` graph are bound to their example values). Backward graphs that AOT autograd
      would build from it are not analysed; use ``boomfx.analyze(..., train=True)`` for a step.
    - Parameters appear as graph inputs, so they are counted in the "input" memory category.
"""
from __future__ import annotations

import threading
import weakref
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx

DEFAULT_DEVICE = "a100-80gb"
_ANALYSIS_OPTIONS = ("device", "alloc_conf", "outside_memory", "db", "from_db")


@dataclass(frozen=True)
class GraphRecord:
    """What the backend learnt about one captured graph: a Report, or why there is none."""

    index: int                      # order of capture, over all boomfx backends of the process
    name: str                       # "graph_<index>" (Dynamo's own name when it sets one)
    num_nodes: int
    report: Any = None              # boomfx.Report, or None when the analysis failed
    warning: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.report is not None


_LOCK = threading.Lock()
_ALL_RECORDS: list[GraphRecord] = []


def records() -> list[GraphRecord]:
    """Every graph recorded by any boomfx backend in this process, failed analyses included."""
    with _LOCK:
        return list(_ALL_RECORDS)


def reports() -> list[Any]:
    """The Reports of the graphs analysed so far (one per captured graph that could be analysed)."""
    return [r.report for r in records() if r.report is not None]


def clear_reports() -> None:
    """Forget every recorded graph (of every boomfx backend)."""
    with _LOCK:
        _ALL_RECORDS.clear()
        for backend in list(_BACKENDS):
            backend.records.clear()


_BACKENDS: "weakref.WeakSet[BoomfxBackend]" = weakref.WeakSet()


class BoomfxBackend:
    """A Dynamo backend that records boomfx's prediction of each graph, then delegates.

    Args:
        delegate: backend that compiles the graph after the analysis: ``"eager"`` (run the
            GraphModule as is), a registered name such as ``"inductor"`` / ``"aot_eager"``, or a
            callable ``(gm, example_inputs) -> callable``.
        device: target device of the prediction.
        delegate_options: passed to the delegate as ``options=`` (e.g. inductor's options).
        alloc_conf, outside_memory, db, from_db: as for ``boomfx.analyze``.
    """

    def __init__(self, delegate: Union[str, Callable[..., Any]] = "eager", device: str = DEFAULT_DEVICE,
                 delegate_options: Optional[dict[str, Any]] = None, alloc_conf: str = "",
                 outside_memory: str = "", db: Optional[str] = None, from_db: Optional[str] = None) -> None:
        self.delegate = delegate
        self.delegate_options = dict(delegate_options or {})
        self.analysis_options = {"device": device, "alloc_conf": alloc_conf, "outside_memory": outside_memory,
                                 "db": db, "from_db": from_db}
        self.records: list[GraphRecord] = []
        _BACKENDS.add(self)

    def reports(self) -> list[Any]:
        return [r.report for r in self.records if r.report is not None]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 options: Optional[dict[str, Any]] = None, mode: Optional[str] = None) -> Callable[..., Any]:
        analysis = dict(self.analysis_options)
        delegate, delegate_options = self.delegate, dict(self.delegate_options)
        for key, value in (options or {}).items():
            if key in _ANALYSIS_OPTIONS:
                analysis[key] = value
            elif key == "delegate":
                delegate = value
            elif key == "delegate_options":
                delegate_options.update(value)
            else:
                raise ValueError(f"boomfx backend: unknown option {key!r} (known: delegate, delegate_options, "
                                 f"{', '.join(_ANALYSIS_OPTIONS)})")
        self._record(gm, example_inputs, analysis)
        return _compile_with(delegate, gm, example_inputs, delegate_options, mode)

    def _record(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], analysis: dict[str, Any]) -> None:
        with _LOCK:
            index = len(_ALL_RECORDS)
        name = f"graph_{index}"
        num_nodes = len(gm.graph.nodes)
        try:
            report = analyze_graph(gm, example_inputs, **analysis)
            report.source = name
            record = GraphRecord(index, name, num_nodes, report)
        except Exception as exc:  # noqa: BLE001  the user's run must go on
            text = str(exc).strip().splitlines()
            message = f"boomfx could not analyse {name}: {type(exc).__name__}: {text[0] if text else ''}"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            record = GraphRecord(index, name, num_nodes, None, message)
        with _LOCK:
            _ALL_RECORDS.append(record)
            self.records.append(record)


def make_backend(delegate: Union[str, Callable[..., Any]] = "eager", device: str = DEFAULT_DEVICE,
                 **options: Any) -> BoomfxBackend:
    """A boomfx backend with its own settings and its own ``records`` (also listed by ``records()``)."""
    return BoomfxBackend(delegate=delegate, device=device, **options)


def _compile_with(delegate: Union[str, Callable[..., Any]], gm: torch.fx.GraphModule,
                  example_inputs: Sequence[Any], options: dict[str, Any], mode: Optional[str]) -> Callable[..., Any]:
    if delegate == "eager" and not options:
        return gm.forward
    if isinstance(delegate, str):
        from torch._dynamo.backends.registry import lookup_backend
        fn = lookup_backend(delegate)
    else:
        fn = delegate
    kwargs: dict[str, Any] = {}
    if options:
        kwargs["options"] = options
    if mode:
        kwargs["mode"] = mode
    return fn(gm, example_inputs, **kwargs)


# --------------------------------------------------------------------------------------------
# Analysis of one Dynamo graph
# --------------------------------------------------------------------------------------------

def trace_to_aten(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """An aten-level copy of a Dynamo graph with fake values on every node, traced without running it.

    The graph is interpreted node by node under ``preserve_node_meta`` so each aten node keeps the
    ``nn_module_stack`` and ``stack_trace`` of the Dynamo node it came from (as AOT autograd does).
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*args: Any) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    fake_mode = next((x.fake_mode for x in example_inputs if isinstance(x, FakeTensor)), None)
    if fake_mode is None:
        # Real inputs: fresh fake copies at their concrete sizes. Tensors the graph holds as
        # attributes (constants, non-inlined parameters) are converted on first use.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        example_inputs = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                          for x in example_inputs]
    with fx_traceback.preserve_node_meta(), torch.no_grad(), fake_mode:
        return make_fx(run, tracing_mode="real")(*example_inputs)


def analyze_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], device: str = DEFAULT_DEVICE,
                  alloc_conf: str = "", outside_memory: str = "", db: Optional[str] = None,
                  from_db: Optional[str] = None) -> Any:
    """The boomfx Report of one Dynamo graph at the sizes of ``example_inputs``."""
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import get_device
    from boomfx.frontend.capture import capture
    from boomfx.integrations.annotate import bind_symbols

    aten_gm = trace_to_aten(gm, example_inputs)
    program = capture(aten_gm)   # an aten graph with fake values: used as is (boomfx/frontend/graphmodule.py)
    spec = get_device(device)
    analysis = Analysis(program, spec, AnalyzeOptions(spec.name, alloc_conf, outside_memory, db, from_db))
    return analysis.evaluate(bind_symbols(program, None, None, None, None)).report


# The backend ``torch.compile(backend="boomfx")`` finds through the ``torch_dynamo_backends`` entry point.
boomfx_backend = BoomfxBackend()
