"""Host work of torch.distributed's training frameworks, measured on this host: FSDP2's hooks per unit and
DTensor's dispatch per tensor-parallel linear.

Why: a CPU step of an FSDP2 model runs, for every unit, Python hooks around the collectives (pre-forward
all-gather and copy-out into each parameter, post-forward reshard, pre-backward, post-backward
``foreach_reduce``: gradient views, ``_chunk_cat``, the sharded gradients set on each parameter). Their
kernels are in the rank program; their Python is not. On this repository's 2-vCPU development VM, at
world size 1 (one process, gloo, one thread, thread time), ``fully_shard`` made a 2-layer Llama's
3.8 ms training step 9.6 ms, and in the calibration below each unit cost 789 / 1515 / 2498 us with 2 / 6
/ 12 parameters: ``fsdp_unit + fsdp_param x parameters`` with 427 us and 181 us.

``measure_fsdp_costs`` fits those two numbers on a calibration model (``Linear(64, 64)`` layers, units of
1 and 6 of them, 2 and 6 units; never a model a benchmark predicts): the training step (forward, mean,
backward, AdamW, ``zero_grad``) with every unit and the root ``fully_shard``ed over a world-1 mesh, minus
the same step unsharded, per added unit. ``boomfx kernels collect --collectives`` stores them as host rows
(``host_overheads.FSDP_UNIT``/``FSDP_PARAM``); ``boomfx/analysis/host_time.py`` charges each unit of a
rank program (``META_FSDP_UNIT`` on its post-backward ``_chunk_cat``) on eager CPU targets.

Tensor parallelism the same way: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` turns a
linear's parameters into DTensors and wraps its input and output; every op on them (forward, backward,
the optimizer's) then goes through DTensor's dispatch. ``measure_tp_linear_ns``: MLP blocks (``Linear(64,
128)`` colwise, ``Linear(128, 64)`` rowwise, with biases), 2 and 6 of them, parallelized over a world-1 mesh
minus the same step plain, per added linear (757 us here; 542 us without biases). Charged per parallel
linear of a rank program, at the all-reduce DTensor issues for it (``META_TP_LINEAR``,
``host_time.tp_linears_before``). At world size 1 a 2-layer Llama (14 parallel linears, no biases) paid
11.7 ms, a 2-layer GPT (4, with biases) 4.2 ms: 10.6 and 3.0 ms by this price.

Known limitations:
- Measured at world size 1: the hooks' Python is the same at any world size; the collectives, timed
  apart, are not in it. The root unit is charged like the others.
- CPU targets only (a GPU host's Python speed is not this one's; a GPU rank's host issue is not modelled
  per hook). The pipelining runtime is not measured. One price per parallel linear, whatever its
  parameters; sequence parallelism's collectives are not counted (q/k/v share one gather).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Optional

import torch

from boomfx.kernels_db.host_overheads import FRAMEWORK_EVENTS, FSDP_PARAM, FSDP_UNIT, TP_LINEAR, host_key
from boomfx.kernels_db.measure import Measurement, Measurer

_WIDTHS = (1, 6)       # Linear layers per unit: 2 and 12 parameters
_DEPTHS = (2, 6)       # units
_WIDTH = 64


class _Unit(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step_ns(units: int, layers: int, mesh: Any, clock: Callable[[], int], steps: int) -> float:
    """Median training step of ``units`` units of ``layers`` linears (sharded over ``mesh``, plain when None)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Unit(layers) for _ in range(units)])
    if mesh is not None:
        for unit in model:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return _timed_steps(model, clock, steps)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(_WIDTH, 2 * _WIDTH)
        self.down = torch.nn.Linear(2 * _WIDTH, _WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _timed_steps(model: torch.nn.Module, clock: Callable[[], int], steps: int) -> float:
    """Median time of a training step of ``model`` (forward, mean, backward, AdamW, zero_grad)."""
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, _WIDTH)

    def step() -> None:
        model(x).mean().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(3):     # AdamW's state on the first
        step()
    samples = []
    for _ in range(steps):
        t0 = clock()
        step()
        samples.append(clock() - t0)
    return float(statistics.median(samples))


def _tp_step_ns(blocks: int, mesh: Any, clock: Callable[[], int], steps: int) -> float:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_MLP() for _ in range(blocks)])
    if mesh is not None:
        for block in model:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return _timed_steps(model, clock, steps)


@contextlib.contextmanager
def _world_of_one() -> Iterator[Any]:
    """A world-1 gloo group made here (and destroyed after), or the caller's if it has one of size 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("the framework calibration needs a world of 1 (it measures one process's host work)")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if own:
            dist.destroy_process_group()


def measure_fsdp_costs(clock: Optional[Callable[[], int]] = None, steps: int = 21) -> dict[str, float]:
    """``{FSDP_UNIT: ns, FSDP_PARAM: ns}``: FSDP2's host work per unit and per parameter of a unit, from the
    calibration of the module doc, in a world-1 gloo group (refused inside a larger one)."""
    clock = clock or _default_clock()
    per_unit = {}
    with _world_of_one() as mesh:
        for layers in _WIDTHS:
            extra = [_step_ns(k, layers, mesh, clock, steps) - _step_ns(k, layers, None, clock, steps) for k in _DEPTHS]
            per_unit[2 * layers] = (extra[1] - extra[0]) / (_DEPTHS[1] - _DEPTHS[0])
    (p0, c0), (p1, c1) = sorted(per_unit.items())
    param_ns = max((c1 - c0) / (p1 - p0), 0.0)
    return {FSDP_UNIT: max(c0 - param_ns * p0, 0.0), FSDP_PARAM: param_ns}


def measure_tp_linear_ns(clock: Optional[Callable[[], int]] = None, steps: int = 21) -> float:
    """DTensor's host work per tensor-parallel linear (module doc), in a world-1 gloo group."""
    clock = clock or _default_clock()
    with _world_of_one() as mesh:
        extra = [_tp_step_ns(k, mesh, clock, steps) - _tp_step_ns(k, None, clock, steps) for k in _DEPTHS]
    return max((extra[1] - extra[0]) / (2 * (_DEPTHS[1] - _DEPTHS[0])), 0.0)


def _default_clock() -> Callable[[], int]:
    """This thread's CPU time with one intra-op thread (other jobs excluded), else wall time."""
    return time.thread_time_ns if torch.get_num_threads() == 1 else time.perf_counter_ns


def collect_framework_costs(store: Any, measurer: Measurer) -> dict[str, float]:
    """Measure the framework events (``measure_fsdp_costs``, ``measure_tp_linear_ns``) and store them as host rows of ``measurer``'s
    fingerprint, replacing earlier ones; returns what was stored."""
    values = {**measure_fsdp_costs(), TP_LINEAR: measure_tp_linear_ns()}
    fingerprint = measurer.fingerprint()
    with store:
        store.put_many([Measurement(v, v, v, 1, v, 0, measurer.source).record(fingerprint, host_key(e))
                        for e, v in values.items() if e in FRAMEWORK_EVENTS])
    return values
