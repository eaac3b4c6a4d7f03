"""Depth-free analysis: pricing each repeated block once gives exactly the numbers of pricing every node."""
from __future__ import annotations

import pytest

from boomfx.analysis.analysis import Analysis
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions


@pytest.mark.parametrize("name,train", [("gpt", False), ("llama", False), ("gpt", True)])
@pytest.mark.parametrize("device", ["h100-sxm", "cpu"])
def test_reuse_equals_no_reuse_to_the_last_digit(exported, name: str, train: bool, device: str) -> None:
    _, path = exported(name)
    program = capture(path, options=ProgramOptions(train=train))
    bindings = resolve_bindings(program, {}, batch=3, seq=40)
    spec = get_device(device)
    with_reuse = Analysis(program, spec, reuse_blocks=True)
    without = Analysis(program, spec, reuse_blocks=False)
    assert with_reuse.blocks.classes and len(with_reuse.blocks.classes[0].instances) == 2
    a = with_reuse.evaluate(bindings).report
    b = without.evaluate(bindings).report
    assert a.time.total_ns == b.time.total_ns
    assert a.time.flops == b.time.flops and a.time.bytes_moved == b.time.bytes_moved
    assert a.memory.total_device_bytes == b.memory.total_device_bytes
    assert [k.time_ns for k in a.kernels] == [k.time_ns for k in b.kernels]
    assert a.blocks[0].instances == 2 and a.blocks[0].time_ns_per_instance > 0
