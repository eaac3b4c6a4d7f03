"""torch.distributed's frameworks' host work (kernels_db/framework_overheads.py): FSDP2's per unit and DTensor's
per tensor-parallel linear; where the rank rewrites mark them, what the eager CPU step charges
(boomfx/analysis/host_time.py), and their measurement on this host."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import boomfx
from boomfx.analysis.analysis import AnalyzeOptions
from boomfx.analysis.host_time import fsdp_units, tp_linears_before
from boomfx.core.devices import get_device
from boomfx.core.program import META_TP_LINEAR, PHASE_BACKWARD, PHASE_FORWARD, ROLE_PARAM, ProgramOptions
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.plan import ParallelConfig
from boomfx.frontend.capture import capture
from boomfx.kernels_db.framework_overheads import collect_framework_costs, measure_fsdp_costs
from boomfx.kernels_db.host_overheads import EVENTS, FSDP_PARAM, FSDP_UNIT, TP_LINEAR, HostCosts, host_key
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.store import Store

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt_tiny.pt2")
UNIT_NS, PARAM_NS, LINEAR_NS = 100_000.0, 10_000.0, 300_000.0


def _host_db(path: Path, unit_ns: float, param_ns: float, linear_ns: float = 0.0) -> str:
    """Host rows only: every event free but the frameworks' (kernels keep their roofline prices)."""
    measurer = Measurer("cpu")
    values = {e: 0.0 for e in EVENTS} | {FSDP_UNIT: unit_ns, FSDP_PARAM: param_ns, TP_LINEAR: linear_ns}
    with Store(path) as store:
        store.put_many([Measurement(v, v, v, 1, v, 0, "measured:cpu").record(measurer.fingerprint(), host_key(e))
                        for e, v in values.items()])
    return str(path)


def test_each_fsdp_unit_pays_its_hooks_once_a_step(tmp_path):
    """gpt_tiny under dp_shard=2: one marked post-backward per unit (its layers and the root), their parameter
    counts summing to the model's parameters; the eager CPU step's dispatch grows by fsdp_unit per unit plus
    fsdp_param per parameter, by hand; a GPU target and a plain (unsharded) program pay nothing."""
    program = capture(GPT, options=ProgramOptions(train=True, target_kind="cpu"))
    params = sum(1 for role in program.input_roles.values() if role == ROLE_PARAM)
    cfg = ParallelConfig.parse("dp_shard=2")
    dist = DistributedAnalysis(program, cfg, get_device("cpu"), AnalyzeOptions("cpu", db="none"))
    (analysis,) = dist.analyses
    units = fsdp_units(list(analysis.program.graph.nodes))
    layers = 2   # gpt_tiny's blocks
    assert len(units) == layers + 1 and sum(units.values()) == params
    by_hand = UNIT_NS * len(units) + PARAM_NS * params
    charged = boomfx.analyze(GPT, device="cpu", train=True, batch=4, seq=32, parallel="dp_shard=2",
                             db=_host_db(tmp_path / "a.sqlite", UNIT_NS, PARAM_NS))
    free = boomfx.analyze(GPT, device="cpu", train=True, batch=4, seq=32, parallel="dp_shard=2",
                          db=_host_db(tmp_path / "b.sqlite", 0.0, 0.0))
    assert charged.time.eager_dispatch_ns - free.time.eager_dispatch_ns == pytest.approx(by_hand)
    assert charged.time.total_ns - free.time.total_ns == pytest.approx(by_hand)
    plain = boomfx.analyze(GPT, device="cpu", train=True, batch=4, seq=32,
                           db=_host_db(tmp_path / "c.sqlite", UNIT_NS, PARAM_NS))
    assert plain.time.eager_dispatch_ns == 0.0
    gpu = boomfx.analyze(GPT, device="h100-sxm", train=True, batch=4, seq=32, parallel="dp_shard=2")
    assert gpu.time.eager_dispatch_ns == 0.0


def test_each_tensor_parallel_linear_pays_dtensor_once_a_step(tmp_path):
    """gpt_tiny under tp=2 splits each block's MLP (fc colwise, fc_out rowwise; its fused qkv stays whole):
    4 parallel linears, each marked once at the all-reduce DTensor issues for it (the rowwise ones' in
    forward, the colwise ones' input gradient in backward); the eager CPU step pays tp_linear for each."""
    program = capture(GPT, options=ProgramOptions(train=True, target_kind="cpu"))
    dist = DistributedAnalysis(program, ParallelConfig.parse("tp=2"), get_device("cpu"), AnalyzeOptions("cpu", db="none"))
    (analysis,) = dist.analyses
    nodes = list(analysis.program.graph.nodes)
    marked = [n for n in nodes if n.meta.get(META_TP_LINEAR)]
    assert [analysis.program.phases[n.name] for n in marked] == [PHASE_FORWARD] * 2 + [PHASE_BACKWARD] * 2
    assert all("all_reduce" in str(n.target) for n in marked)
    assert sum(tp_linears_before(nodes, analysis.costs.by_node).values()) == 4
    charged = boomfx.analyze(GPT, device="cpu", train=True, batch=4, seq=32, parallel="tp=2",
                             db=_host_db(tmp_path / "a.sqlite", UNIT_NS, PARAM_NS, LINEAR_NS))
    free = boomfx.analyze(GPT, device="cpu", train=True, batch=4, seq=32, parallel="tp=2",
                          db=_host_db(tmp_path / "b.sqlite", UNIT_NS, PARAM_NS, 0.0))
    assert charged.time.eager_dispatch_ns - free.time.eager_dispatch_ns == pytest.approx(4 * LINEAR_NS)


def test_fsdp_hooks_measured_at_world_one_and_stored(tmp_path):
    """The calibration runs real fully_shard steps in a world-1 gloo group of its own (and leaves none behind);
    a unit with more parameters costs more, so both terms are positive here; the stored rows price them."""
    import torch.distributed as dist
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values = collect_framework_costs(Store(tmp_path / "h.sqlite"), Measurer("cpu"))
    finally:
        torch.set_num_threads(before)
    assert not dist.is_initialized()
    assert values[FSDP_UNIT] > 0 and values[FSDP_PARAM] > 0 and values[TP_LINEAR] > 0
    with Store(tmp_path / "h.sqlite") as store:
        costs = HostCosts.from_records(list(store.records()), "cpu")
    assert all(costs.values[e] == values[e] for e in (FSDP_UNIT, FSDP_PARAM, TP_LINEAR))
    assert costs.source == "partly measured"      # the plain collection's events are not in this file
    assert costs.fsdp_ns(9) == pytest.approx(values[FSDP_UNIT] + 9 * values[FSDP_PARAM])
    assert costs.tp_ns(14) == pytest.approx(14 * values[TP_LINEAR])


def test_measurement_refuses_a_larger_world(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="world of 1"):
        measure_fsdp_costs()
