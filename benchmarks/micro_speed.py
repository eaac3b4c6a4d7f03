"""Speed of the hot inner pieces, written to benchmarks/results/micro_speed.json (never asserted in tests):
allocator replay of 100k random events, and kernel-price lookups per call.

    python benchmarks/micro_speed.py
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import sympy
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def replay_100k() -> float:
    from boomfx.memory.config import AllocatorConfig
    GiB = 1 << 30
    from boomfx.memory.replay import AllocEvent, replay
    rng = random.Random(0)
    events, live, next_id = [], [], 0
    while len(events) < 100_000:
        if live and (len(live) > 200 or rng.random() < 0.45):
            events.append(AllocEvent("free", live.pop(rng.randrange(len(live))), 0))
        else:
            size = rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 64 << 20)])
            events.append(AllocEvent("alloc", next_id, size))
            live.append(next_id)
            next_id += 1
    started = time.perf_counter()
    replay(events, AllocatorConfig(), capacity_bytes=80 * GiB)
    return time.perf_counter() - started


def price_per_call_ms(n: int = 500) -> float:
    from boomfx.core.devices import get_device
    from boomfx.kernels_db.lookup import KernelPricer
    from boomfx.passes.costs.registry import OpCall, price_call
    from boomfx.passes.specs import TensorSpec, contiguous_strides
    pricer = KernelPricer(None, get_device("a100"))
    calls = []
    for i in range(n):
        shape = (sympy.Integer(1000 + i), sympy.Integer(64))
        spec = TensorSpec(shape, contiguous_strides(shape), torch.float32)
        call = OpCall.build(torch.ops.aten.relu.default, (spec,), {}, (spec,))
        calls.append((call, price_call(call).cost))
    started = time.perf_counter()
    for call, cost in calls:
        pricer.price(call, cost)
    return (time.perf_counter() - started) / n * 1e3


def main() -> None:
    results = {"replay_100k_events_s": replay_100k(), "price_per_new_call_ms": price_per_call_ms()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "micro_speed.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
