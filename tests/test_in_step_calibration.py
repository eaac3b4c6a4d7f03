"""The probe's in-step calibration (kernels_db/in_step_calibration.py): its program, its band ratios by hand,
and a real run on this CPU."""
from __future__ import annotations

import json
import math

import pytest

from boomfx.kernels_db.cpu_model import BOUNDS, CpuKernelModel
from boomfx.kernels_db.host_probe import _median_ns, host_profile
from boomfx.kernels_db.in_step_calibration import (band_ratios, calibration_program, measure_in_step_pairs,
                                                   ratios_by_bound)
from boomfx.kernels_db.keys import kernel_key


def test_band_ratios_by_hand():
    """Median ratio per band of looped time at the band's geometric-mean time; empty bands left out; a call
    faster in the step than alone counts as 1."""
    pairs = [(2e3, 6e3), (4e3, 8e3), (3e3, 3e3),          # under 5 us: ratios 3, 2, 1 -> median 2
             (100e3, 90e3),                              # 80-300 us: 0.9 -> 1
             (2e6, 2.2e6), (8e6, 8.8e6)]                 # over 1 ms: 1.1, 1.1
    rates = band_ratios(pairs)
    assert [r for _, r in rates] == pytest.approx([2.0, 1.0, 1.1])
    assert rates[0][0] == pytest.approx((2e3 * 4e3 * 3e3) ** (1 / 3))
    assert rates[2][0] == pytest.approx(math.sqrt(2e6 * 8e6))
    assert band_ratios([]) == ()


def test_the_calibration_program_flows_activations_and_keys_every_call():
    """Every call has a fixed kernel key and operands aligned with its tensor arguments; each activation it
    reads by name was written by an earlier call (the flow a real step has), weights are its own."""
    calls, operands = calibration_program()
    assert len(calls) == len(operands) == 167
    written: set[str] = set()
    for call, ops in zip(calls, operands):
        key = kernel_key(call)                            # raises on a call the rotation could not build
        assert len(ops.inputs) == len(json.loads(key.key_json)["tensors"])
        assert all(o is None or o.value in written for o in ops.inputs)
        written.update(o.value for o in ops.outputs)
    assert sum(o is not None for ops in operands for o in ops.inputs) > 60


def test_a_real_calibration_on_this_cpu():
    """On this host: ratios for every bound the calibration's calls have, none below 1, and a step slows a
    few-microsecond pointwise call more than a millisecond GEMM (its blocking reuses its operands)."""
    profile = host_profile()
    if profile is None:
        pytest.skip("the host probe is off")
    pairs = measure_in_step_pairs(_median_ns, target_s=0.3)
    assert len(pairs) == len({kernel_key(c).key_hash for c in calibration_program()[0]})
    ratios = ratios_by_bound(pairs, CpuKernelModel(profile).bound)
    assert set(ratios) == set(BOUNDS)
    assert all(r >= 1.0 for rates in ratios.values() for _, r in rates)
    assert ratios["memory"][0][0] < 10e3 < 1e6 < ratios["matmul"][-1][0]
    assert ratios["memory"][0][1] > ratios["matmul"][-1][1]
