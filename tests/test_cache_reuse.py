"""Warm/cold kernel rows and the reuse-distance blend (passes/cache_reuse.py), with known answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import sympy
import torch

from boomfx.kernels_db.collectors import build_call, spec
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurer, split_warm_key, warm_key
from boomfx.kernels_db.store import Store
from boomfx.passes.cache_reuse import ReusePlan, ReuseWalk, apply_cache_reuse, blended_ns, hot_bytes
from boomfx.passes.evaluate import Evaluator

aten = torch.ops.aten
CACHE = 1000


@dataclass
class _Kernel:            # the fields apply_cache_reuse reads of a KernelReport
    node: str
    bytes_moved: int
    time_ns: float


@dataclass(frozen=True)
class _Scheduled:         # ... and of a (frozen) ScheduledKernel
    name: str
    device_ns: float


@dataclass(frozen=True)
class _Price:
    warm_ns: Optional[float]


def _plan(inputs: dict, outputs: dict, sizes: list[int]) -> ReusePlan:
    return ReusePlan(inputs, outputs, tuple(sympy.Integer(s) for s in sizes), CACHE)


def _run(plan: ReusePlan, moved: dict[str, int], warm: float = 10.0, cold: float = 110.0) -> dict[str, float]:
    kernels = [_Kernel(name, nbytes, cold) for name, nbytes in moved.items()]
    scheduled = [_Scheduled(name, cold + 1.0) for name in moved]
    apply_cache_reuse(plan, kernels, scheduled, lambda n: _Price(warm), Evaluator({}))
    for k, s in zip(kernels, scheduled):
        assert s.device_ns == k.time_ns + 1.0      # the scheduled time follows the report's (+ host)
    return {k.node: k.time_ns for k in kernels}


def test_blend_formula() -> None:
    assert blended_ns(10.0, 40.0, 0.0) == 10.0
    assert blended_ns(10.0, 40.0, 1.0) == 40.0
    assert blended_ns(10.0, 40.0, 0.5) == 25.0
    assert blended_ns(10.0, 40.0, 2.0) == 40.0       # shares are clamped to [0, 1]


def test_hot_bytes() -> None:
    assert hot_bytes(100, None, CACHE) == 0          # never touched in the step: cold
    assert hot_bytes(100, 0, CACHE) == 100
    assert hot_bytes(100, 950, CACHE) == 50          # half of it pushed out
    assert hot_bytes(100, 1500, CACHE) == 0
    assert hot_bytes(3000, 0, CACHE) == CACHE        # larger than the cache: never fully hot


def test_reuse_distances_on_a_hand_made_sequence() -> None:
    # storage 0: resident (a parameter); a writes 1 from 0; b re-reads 1 at once (hot); c streams
    # 2000 bytes through 2 and 3; d reads 1 again and 0: both last touched > 2000 bytes ago (cold)
    plan = _plan({"a": (0,), "b": (1,), "c": (2,), "d": (1, 0)},
                 {"a": (1,), "b": (4,), "c": (3,), "d": (5,)}, [100, 100, 1000, 1000, 100, 100])
    times = _run(plan, {"a": 200, "b": 200, "c": 2000, "d": 300})
    assert times["a"] == 110.0      # resident input at the start of the step: cold
    assert times["b"] == 10.0       # re-read right after being written: warm
    assert times["c"] == 110.0      # resident input: cold
    assert times["d"] == 110.0      # both inputs were last touched > cache bytes of traffic ago


def test_partial_share_weighs_input_bytes() -> None:
    # e reads 1 (300 bytes, just written: hot) and 0 (100 bytes, resident: cold): cold share 1/4
    plan = _plan({"w": (2,), "e": (1, 0)}, {"w": (1,), "e": (3,)}, [100, 300, 300, 300])
    times = _run(plan, {"w": 600, "e": 700}, warm=10.0, cold=50.0)
    assert times["e"] == pytest.approx(10.0 + 40.0 * 0.25)


def test_compute_kernels_are_as_cold_as_their_coldest_input() -> None:
    # the same reads as above, but e is a matmul-like kernel: its resident input makes it cold
    plan = ReusePlan({"w": (2,), "e": (1, 0)}, {"w": (1,), "e": (3,)},
                     tuple(sympy.Integer(s) for s in [100, 300, 300, 300]), CACHE, frozenset({"e"}))
    times = _run(plan, {"w": 600, "e": 700}, warm=10.0, cold=50.0)
    assert times["e"] == 50.0


def test_views_and_kernels_without_warm_rows_keep_their_price() -> None:
    plan = _plan({"v": (0,), "k": (0,)}, {"v": (0,), "k": (1,)}, [100, 100])
    kernels = [_Kernel("v", 0, 7.0), _Kernel("k", 200, 30.0)]
    apply_cache_reuse(plan, kernels, [_Scheduled("v", 7.0), _Scheduled("k", 30.0)], lambda n: _Price(None),
                      Evaluator({}))
    assert [k.time_ns for k in kernels] == [7.0, 30.0]


def test_walk_is_cold_until_touched() -> None:
    walk = ReuseWalk(_plan({"x": (0,)}, {"x": (1,)}, [100, 100]), lambda sid: 100)
    assert walk.cold_share("x") == 1.0
    walk.touch("x", 200)
    assert walk.cold_share("x") == 0.0
    assert walk.cold_share("nothing") == 0.0          # no tensor input: warm


def test_a_kernel_over_many_storages_leaves_only_the_last_in_cache() -> None:
    # f streams three 600-byte storages (a foreach op over optimizer state) through a 1000-byte cache
    plan = _plan({"f": (0, 1, 2), "r0": (0,), "r1": (1,), "r2": (2,)}, {}, [600, 600, 600])
    walk = ReuseWalk(plan, lambda sid: 600)
    walk.touch("f", 1800)
    assert walk.cold_share("r0") == 1.0              # 1200 bytes streamed after it
    assert walk.cold_share("r1") == pytest.approx(1 - 400 / 600)
    assert walk.cold_share("r2") == 0.0


def _relu_key(n: int = 256):
    return kernel_key(build_call(aten.relu.default, (spec((n,), torch.float32),)))


def _flush_measurer() -> Measurer:
    return Measurer("cpu", target_s=0.002, min_runs=3, num_threads=1, cpu_flush_bytes=1 << 20,
                    cold_max_runs=7, measure_workspace=False, cpu_hot_bytes=256 << 10)


def test_measurer_stores_cold_and_warm_rows(tmp_path) -> None:
    key = _relu_key()
    measurer = _flush_measurer()
    m = measurer.measure(key)
    assert m.warm is not None and m.flush_bytes == 1 << 20 and m.hot_bytes == 256 << 10
    assert m.n_runs <= 7                                  # flushed samples are capped
    assert m.median_ns >= m.warm.median_ns                # tiny op: cold is not faster than warm
    rows = m.records(measurer.fingerprint(), key)
    assert [r.median_ns for r in rows] == [m.median_ns, m.warm.median_ns]
    warm_data, cold_data = rows[1].key.data, key.data
    warm_data["context"].pop("boomfx_cache")
    assert warm_data == cold_data                         # the keys differ only by the context flag
    assert split_warm_key(rows[1].key) == (key.key_hash, 256 << 10)     # the warm cache size
    assert split_warm_key(key) is None


def test_warm_key_without_hot_bytes_falls_back_to_the_flush_size() -> None:
    key = _relu_key()
    assert split_warm_key(warm_key(key, 4096)) == (key.key_hash, 4096)
    assert split_warm_key(warm_key(key, 4096, 512)) == (key.key_hash, 512)


def test_private_cache_bytes_is_positive() -> None:
    from boomfx.kernels_db.measure import private_cache_bytes

    assert private_cache_bytes() > 0
    assert private_cache_bytes(default=12345, cpu=10**6) == 12345      # no such CPU: the default


def test_unflushed_measurer_has_no_warm_row() -> None:
    key = _relu_key()
    measurer = Measurer("cpu", target_s=0.002, min_runs=3, num_threads=1, measure_workspace=False)
    m = measurer.measure(key)
    assert m.warm is None and len(m.records(measurer.fingerprint(), key)) == 1


def test_csv_round_trip_keeps_the_warm_row(tmp_path) -> None:
    from boomfx.devices import cpu_spec
    from boomfx.kernels_db.lookup import KernelPricer
    from boomfx.kernels_db.schema import KernelRecord
    from boomfx.passes.costs.registry import Cost

    key = _relu_key()
    fp = Measurer("cpu", num_threads=1).fingerprint()
    cold = KernelRecord(fp, key, 500.0, 450.0, 550.0, 5, 100.0, 0, "measured:cpu")
    warm = KernelRecord(fp, warm_key(key, 4096), 200.0, 190.0, 210.0, 9, 100.0, 0, "measured:cpu")
    with Store(tmp_path / "a.sqlite") as a:
        a.put_many([cold, warm])
        assert a.export_csv(tmp_path / "a.csv") == 2
    with Store(tmp_path / "b.sqlite") as b:
        assert b.import_csv(tmp_path / "a.csv").inserted == 2
    pricer = KernelPricer(Store(tmp_path / "b.sqlite"), cpu_spec())
    assert len(pricer) == 1 and pricer.cache_bytes == 4096   # the warm row is no kernel of its own
    call = build_call(aten.relu.default, (spec((256,), torch.float32),))
    price = pricer.price(call, Cost(0, 1024, 1024))
    assert price.time_ns == 500.0 and price.warm_ns == 200.0


@pytest.fixture(scope="module")
def small_analysis(tmp_path_factory):
    """A tiny MLP, its kernels collected with a flush into one DB and a copy without the warm rows."""
    from boomfx.analyze import Analysis, AnalyzeOptions
    from boomfx.capture import capture, resolve_bindings
    from boomfx.devices import cpu_spec
    from boomfx.kernels_db.collect import collect_calls
    from boomfx.program import ProgramOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ep = torch.export.export(model, (torch.randn(16, 64),))
    program = capture(ep, options=ProgramOptions(False, target_kind="cpu"))
    device = cpu_spec()
    bindings = resolve_bindings(program, {}, None, None)
    calls = Analysis(program, device, AnalyzeOptions(device.name, db="none")).kernel_calls(bindings)
    root = tmp_path_factory.mktemp("reuse")
    both, cold_only = root / "both.sqlite", root / "cold.sqlite"
    collect_calls(Store(both), calls, measurer=_flush_measurer())
    with Store(both) as src, Store(cold_only) as dst:
        dst.put_many([r for r in src.records() if split_warm_key(r.key) is None])

    def analyse(db):
        return Analysis(program, device, AnalyzeOptions(device.name, db=str(db)))
    return analyse(both), analyse(cold_only), bindings


def test_db_without_warm_rows_prices_as_before(small_analysis) -> None:
    _, cold_only, bindings = small_analysis
    assert cold_only._reuse is None
    report = cold_only.evaluate(bindings).report
    for k in report.kernels:
        rec_price = cold_only._price_node(k.node, cold_only.evaluator(bindings))[0]
        assert k.time_ns == rec_price.time_ns and rec_price.warm_ns is None


def test_db_with_warm_rows_blends(small_analysis) -> None:
    both, _, bindings = small_analysis
    assert both._reuse is not None and both._reuse.cache_bytes == 256 << 10
    ev = both.evaluator(bindings)
    report = both.evaluate(bindings).report
    relu = [k for k in report.kernels if "relu" in k.op]
    assert len(relu) == 1
    price = both._price_node(relu[0].node, ev)[0]
    assert price.warm_ns is not None
    assert relu[0].time_ns == pytest.approx(price.warm_ns)   # reads what the addmm just wrote: warm
    for k in report.kernels:
        p = both._price_node(k.node, ev)[0]
        if p.warm_ns is not None:
            assert min(p.warm_ns, p.time_ns) - 1e-6 <= k.time_ns <= max(p.warm_ns, p.time_ns) + 1e-6
    assert report.time.total_ns == pytest.approx(sum(k.time_ns for k in report.kernels), rel=1e-9)
    assert {k.source for k in report.kernels} <= {"measured", "interpolated", "roofline"}
