"""The device registry (every figure present and sourced) and ``--device-spec`` files (round trip, bad input)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from boomfx.cli.main import main
from boomfx.core.device_spec_file import device_spec_from_dict, device_spec_to_dict, load_device_spec
from boomfx.core.devices import GPUS, get_device
from boomfx.core.errors import OptionError

ISSUE_16_DEVICES = ("l40s", "l40", "a40", "a30", "rtx-a6000", "rtx-6000-ada", "rtx-2080-ti", "rtx-3060",
                    "rtx-3070", "rtx-3080", "rtx-3080-ti", "rtx-4060", "rtx-4070", "rtx-4080", "rtx-5090",
                    "b200", "h20")


@pytest.mark.parametrize("spec", GPUS, ids=lambda s: s.name)
def test_every_gpu_has_the_required_figures_and_a_source(spec):
    assert spec.kind == "cuda" and spec.description
    assert spec.peak_flops_per_s[torch.float32] > 0
    assert torch.float16 in spec.peak_flops_per_s
    assert spec.memory_bandwidth_bytes_per_s > 0 and spec.memory_bytes > 0
    assert spec.sm_count > 0 and spec.l2_bytes > 0 and spec.compute_capability >= (6, 0)
    assert spec.memory_class in ("hbm", "gddr")
    assert spec.sources and all(len(s) > 20 for s in spec.sources.values())
    # dense tensor-core peaks are at least the fp32 rate, and fp8 (where listed) at least the bf16 rate
    for dtype in (torch.float16, torch.bfloat16):
        if dtype in spec.peak_flops_per_s:
            assert spec.peak_flops_per_s[dtype] >= spec.peak_flops_per_s[torch.float32] * 0.99
    if torch.float8_e4m3fn in spec.peak_flops_per_s:
        assert spec.peak_flops_per_s[torch.float8_e4m3fn] >= spec.peak_flops_per_s[torch.bfloat16]
        assert spec.compute_capability >= (8, 9)   # fp8 tensor cores: Ada, Hopper, Blackwell


def test_the_issue_16_devices_are_registered():
    names = {s.name for s in GPUS}
    assert set(ISSUE_16_DEVICES) <= names
    assert len(names) == len(GPUS)   # no duplicates
    # GeForce fp16 with fp32 accumulate: half the fp16-accumulate marketing figure (Ampere whitepaper:
    # RTX 3090 142 TF fp16-accumulate -> 71 TF); professional boards run it at the full rate.
    assert get_device("rtx-3090").peak_flops_per_s[torch.float16] == pytest.approx(71e12)
    assert get_device("l40s").peak_flops_per_s[torch.bfloat16] == pytest.approx(362.05e12)


@pytest.mark.parametrize("name", ("a100-80gb", "l40s", "rtx-5090", "b200", "cpu"))
def test_spec_file_round_trips(tmp_path, name):
    spec = get_device(name)
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(device_spec_to_dict(spec)))
    assert load_device_spec(path) == spec


@pytest.mark.parametrize("doc, message", [
    ({"kind": "cuda"}, "missing required field"),
    ({"name": "x", "kind": "tpu", "peak_flops_per_s": {"float32": 1e12}, "memory_bandwidth_bytes_per_s": 1e9,
      "memory_bytes": 1}, "kind must be one of"),
    ({"name": "x", "kind": "cuda", "peak_flops_per_s": {"bfloat16": 1e12}, "memory_bandwidth_bytes_per_s": 1e9,
      "memory_bytes": 1, "sm_count": 1}, "float32 entry"),
    ({"name": "x", "kind": "cuda", "peak_flops_per_s": {"float32": 1e12, "floaty": 1}, "memory_bandwidth_bytes_per_s": 1e9,
      "memory_bytes": 1, "sm_count": 1}, "not a torch floating dtype"),
    ({"name": "x", "kind": "cuda", "peak_flops_per_s": {"float32": 1e12}, "memory_bandwidth_bytes_per_s": -5,
      "memory_bytes": 1, "sm_count": 1}, "non-negative number"),
    ({"name": "x", "kind": "cuda", "peak_flops_per_s": {"float32": 1e12}, "memory_bandwidth_bytes_per_s": 1e9,
      "memory_bytes": 1, "sm_count": 1, "bandwith": 3}, "unknown field"),
])
def test_bad_spec_is_one_option_error(doc, message):
    with pytest.raises(OptionError, match=message):
        device_spec_from_dict(doc)


def test_cli_device_spec_prices_like_the_registered_device(capsys, tmp_path, examples_dir: Path):
    # an A100 80 GB under another name: no own calibration, so the model borrows the measured GPU of the
    # same compute capability -- the a100-80gb itself -- and the step must come out identical.
    spec = replace(get_device("a100-80gb"), name="my-a100", aliases=())
    path = tmp_path / "my_a100.json"
    path.write_text(json.dumps(device_spec_to_dict(spec)))
    args = ["analyze", str(examples_dir / "gpt_tiny.pt2"), "--batch", "4", "--seq", "32", "--json", "--train",
            "--amp", "bf16"]
    assert main(args + ["--device", "a100-80gb"]) == 0
    registered = json.loads(capsys.readouterr().out)
    assert main(args + ["--device-spec", str(path)]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["device"] == "my-a100"
    assert described["time"]["total_ns"] == pytest.approx(registered["time"]["total_ns"])


@pytest.mark.parametrize("content", ["{not json", json.dumps({"name": "x"}), None])
def test_cli_bad_device_spec_is_one_line_exit_2(capsys, tmp_path, examples_dir: Path, content):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    code = main(["analyze", str(examples_dir / "gpt_tiny.pt2"), "--device-spec", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("boomfx: error: --device-spec") and err.count("\n") == 1


def test_names_and_aliases_are_unique() -> None:
    """One entry per device: a second entry with a taken name or alias would be unreachable (get_device
    returns the first match)."""
    from boomfx.core.devices import GPUS
    seen: dict[str, str] = {}
    for spec in GPUS:
        for key in (spec.name, *spec.aliases):
            assert key not in seen, f"{key} names both {seen[key]} and {spec.name}"
            seen[key] = spec.name
