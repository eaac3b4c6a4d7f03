"""--amp and --train re-trace the export graph; that must never change the amount of work.

MobileNetV2 and EfficientNet pad their inputs (TF-style ``pad``), Swin pads and partitions windows:
C++ kernels that read sizes as plain ints used to fix the batch symbol to the trace's example size
(17), so every later kernel was priced at batch 17 (1024 / 17 = 60x too few FLOPs at batch 1024)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import boomfx
from boomfx.frontend.capture import capture
from boomfx.core.program import ProgramOptions

CONV_MODELS = ["mobilenet_v2", "swin", "efficientnet"]
BATCH = 1024


def _flops(path: str, batch: int, **options) -> float:
    return boomfx.analyze(path, device="h100-sxm", batch=batch, **options).time.flops


@pytest.mark.parametrize("name", CONV_MODELS)
def test_amp_keeps_the_flops_of_inference(zoo, name: str) -> None:
    """Inference FLOPs are per-image work plus a batch-free part (eval BatchNorm's per-channel scale):
    F(b) = a*b + c, so F(1024) - F(2) = 511 * (F(4) - F(2)); and --amp keeps F(1024)."""
    _, path = zoo(name)
    fp32 = _flops(path, BATCH)                       # the export graph itself, never re-traced
    assert fp32 - _flops(path, 2) == pytest.approx(511 * (_flops(path, 4) - _flops(path, 2)), rel=1e-9)
    assert _flops(path, BATCH, amp="bf16") == pytest.approx(fp32, rel=1e-9)
    if name == "mobilenet_v2":
        assert _flops(path, BATCH, amp="fp16") == pytest.approx(fp32, rel=1e-9)


def _shapes_without_casts(program) -> Counter:
    """(op, output shapes) of every op but autocast's dtype casts, with the batch symbol kept."""
    out: Counter = Counter()
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is torch.ops.aten._to_copy.default:
            continue
        vals = node.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else [vals]
        out[(str(node.target), tuple(str(tuple(v.shape)) for v in vals if isinstance(v, torch.Tensor)))] += 1
    return out


@pytest.mark.parametrize("name", ["mobilenet_v2", "swin"])
def test_amp_training_step_has_the_same_kernels_as_fp32(zoo, name: str) -> None:
    """--train --amp bf16 runs the fp32 step's kernels on the same shapes (only dtypes and casts differ),
    and its FLOPs equal fp32's."""
    _, path = zoo(name)
    fp32 = capture(path, options=ProgramOptions(train=True))
    bf16 = capture(path, options=ProgramOptions(train=True, amp="bf16"))
    batch = next(info.symbol for info in fp32.symbols.values() if info.role == "batch")
    first_input = next(n for n in bf16.graph.nodes if n.op == "placeholder" and bf16.input_roles[n.name] == "input")
    assert first_input.meta["val"].shape[0].node.expr == batch      # still symbolic after the re-trace
    assert _shapes_without_casts(bf16) == _shapes_without_casts(fp32)
    assert _flops(path, BATCH, train=True, amp="bf16") == pytest.approx(_flops(path, BATCH, train=True), rel=1e-9)
