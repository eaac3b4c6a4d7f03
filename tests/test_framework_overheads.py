"""FSDP2's host work per unit (kernels_db/framework_overheads.py): where the rank rewrite marks a unit, what the
eager CPU step charges for it (boomfx/analysis/host_time.py), and its measurement on this host."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import boomfx
from boomfx.analysis.analysis import AnalyzeOptions
from boomfx.analysis.host_time import fsdp_units
from boomfx.core.devices import get_device
from boomfx.core.program import ROLE_PARAM, ProgramOptions
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.plan import ParallelConfig
from boomfx.frontend.capture import capture
from boomfx.kernels_db.framework_overheads import collect_framework_costs, measure_fsdp_costs
from boomfx.kernels_db.host_overheads import EVENTS, FSDP_PARAM, FSDP_UNIT, HostCosts, host_key
from boomfx.kernels_db.measure import Measurement, Measurer
from boomfx.kernels_db.store import Store

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt_tiny.pt2")
UNIT_NS, PARAM_NS = 100_000.0, 10_000.0


def _host_db(path: Path, unit_ns: float, param_ns: float) -> str:
    """Host rows only: every event free but FSDP2's (kernels keep their roofline prices)."""
    measurer = Measurer("cpu")
    values = {e: 0.0 for e in EVENTS} | {FSDP_UNIT: unit_ns, FSDP_PARAM: param_ns}
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
    assert values[FSDP_UNIT] > 0 and values[FSDP_PARAM] > 0
    with Store(tmp_path / "h.sqlite") as store:
        costs = HostCosts.from_records(list(store.records()), "cpu")
    assert costs.values[FSDP_UNIT] == values[FSDP_UNIT] and costs.values[FSDP_PARAM] == values[FSDP_PARAM]
    assert costs.source == "partly measured"      # the plain collection's events are not in this file
    assert costs.fsdp_ns(9) == pytest.approx(values[FSDP_UNIT] + 9 * values[FSDP_PARAM])


def test_measurement_refuses_a_larger_world(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="world of 1"):
        measure_fsdp_costs()
