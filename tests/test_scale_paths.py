"""Scale fast paths (benchmarks/speed_llama70b.py): each must give exactly what the slow path gives.

- ``analyze._eager_autograd_liveness`` hands changed uses to ``liveness_pass(uses=...)`` instead of
  running the pass on a rewritten copy of the graph: compared with that copy-based reference here.
- ``opcall.bind_value`` caches bound TensorSpecs per Evaluator; a plain callable has no cache.
- ``costs.pointwise.bytes_of``/``numel_of`` sum with one sympy Add.
- ``pt2_fast`` builds lazy GraphModules (code generated on first use).
- ``gc_pause.gc_paused`` restores the collector's state.
"""
from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
import sympy
import torch

from boomfx.passes.liveness import _SIZE_QUERIES, _eager_autograd_liveness
from boomfx.frontend.capture import capture
from boomfx.core.gc_pause import gc_paused
from boomfx.passes.costs.pointwise import bytes_of, numel_of, unique_bytes
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import liveness_pass
from boomfx.passes.opcall import bind_call, bind_value
from boomfx.passes.shapes import cost_pass
from boomfx.passes.manager import AnalysisManager
from boomfx.passes.specs import TensorSpec
from boomfx.core.devices import get_device
from boomfx.core.program import PHASE_BACKWARD, ProgramOptions

from conftest import export_meta

def _copy_based_eager_liveness(program):
    """The former implementation: the liveness pass on a copy of the graph whose size queries read no
    tensor and whose last node of each backward autograd node also reads the group's inputs."""
    graph = torch.fx.Graph()
    env: dict = {}
    graph.output(graph.graph_copy(program.graph, env))
    group: list = []

    def close(nodes: list) -> None:
        if len(nodes) > 1:
            used: dict = {}
            for n in nodes:
                if n.target not in _SIZE_QUERIES:
                    used.update(dict.fromkeys(n.all_input_nodes))
            last = nodes[-1]
            # the group's own temporaries are not held to its end (they die at their last use)
            extra = tuple(u for u in used if u is not last and u not in last.all_input_nodes and u not in nodes)
            if extra:
                last.args = tuple(last.args) + extra
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _SIZE_QUERIES:
            node.args = (None,) + tuple(node.args[1:])
        seq = node.meta.get("seq_nr") if program.phases.get(node.name) == PHASE_BACKWARD else None
        if group and (seq is None or group[-1].meta.get("seq_nr") != seq):
            close(group)
            group = []
        if seq is not None:
            group.append(node)
    close(group)
    return liveness_pass(dataclasses.replace(program, gm=torch.fx.GraphModule(program.gm, graph)))


@pytest.mark.parametrize("name,layers,checkpoint,optimizer", [
    ("llama", 3, False, "adamw"), ("gpt", 2, True, "adamw"), ("llama", 8, False, "sgd"), ("gpt", 7, True, "adam"),
])
def test_eager_liveness_without_a_copy_equals_the_copy_based_one(name, layers, checkpoint, optimizer) -> None:
    program = capture(export_meta(name, layers),
                      options=ProgramOptions(train=True, checkpoint=checkpoint, optimizer=optimizer))
    ours, reference = _eager_autograd_liveness(program), _copy_based_eager_liveness(program)
    assert ours.order == reference.order
    assert ours.intervals == reference.intervals
    # and the uses really differ from the plain pass (the override is exercised)
    assert liveness_pass(program).intervals != ours.intervals


class _Plain:
    """An evaluator without ``bound_specs``/``bindings``: the uncached, exception-driven path."""

    def __init__(self, ev: Evaluator) -> None:
        self.ev = ev

    def __call__(self, expr):
        return self.ev(expr)

    def number(self, expr):
        return self.ev.number(expr)


def test_bound_specs_are_cached_per_evaluator_and_equal_uncached_binding() -> None:
    program = capture(export_meta("llama", 8), options=ProgramOptions(train=True))
    costs = cost_pass(program, AnalysisManager(program, get_device("h100-sxm")))
    syms = {s.symbol: v for s, v in zip(program.symbols.values(), (3, 40))}
    symbol_map = program.gm.meta.get("boomfx.symbol_map", {})
    ev = Evaluator(syms, symbol_map)
    plain = Evaluator(syms, symbol_map)
    foreach = [nc.call for nc in costs.by_node.values() if "_foreach_" in str(nc.call.op)]
    assert foreach, "an AdamW step has foreach ops"
    for nc in costs.by_node.values():
        cached = bind_call(nc.call, ev)
        uncached = bind_call(nc.call, _Plain(plain))   # no spec cache, no bindings to check against
        assert cached == uncached
    assert ev.bound_specs, "the Evaluator kept bound specs"
    # a spec is bound once per evaluator, then reused
    spec = next(iter(ev.bound_specs))
    assert bind_value(spec, ev) is ev.bound_specs[spec]


def test_data_dependent_scalars_stay_symbolic_when_bound() -> None:
    s, u = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("zuf0", integer=True)
    ev = Evaluator({s: 4})
    assert bind_value(s * 2, ev) == 8
    assert bind_value(u + 1, ev) == u + 1          # unbound: kept as is, no exception
    assert bind_value(sympy.Float(0.5) * u, ev) == sympy.Float(0.5) * u


def test_bytes_and_numel_sums_equal_term_by_term_sums() -> None:
    s = sympy.Symbol("s0", integer=True, positive=True)
    specs = [TensorSpec((s, sympy.Integer(8)), (sympy.Integer(8), sympy.Integer(1)), torch.float32),
             TensorSpec((sympy.Integer(4), s), (sympy.Integer(0), sympy.Integer(1)), torch.bfloat16)] * 50
    values = [specs[:7], None, 3, tuple(specs[7:]), specs[0]]
    by_terms, numel = sympy.Integer(0), sympy.Integer(0)
    for t in specs + [specs[0]]:
        by_terms = by_terms + unique_bytes(t)
        numel = numel + t.numel
    assert bytes_of(values) == by_terms
    assert numel_of(values) == numel
    assert bytes_of([]) == 0 and numel_of([None]) == 0


def test_loaded_graph_modules_generate_code_lazily_and_still_run(tmp_path: Path) -> None:
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from boomfx.frontend.loader import load_program
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),)), path)
    ep = load_program(path)
    assert isinstance(ep.graph_module, _LazyGraphModule)
    assert "linear" in ep.graph_module.code          # generated on first use
    # the export of torch's own loader is unchanged (the patch is scoped to our deserializer)
    assert not isinstance(torch.export.load(path).graph_module, _LazyGraphModule)


def test_gc_paused_restores_the_collector() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()            # was off: stays off
    finally:
        gc.enable()
    with pytest.raises(ValueError):
        with gc_paused():
            raise ValueError("boom")
    assert gc.isenabled()
