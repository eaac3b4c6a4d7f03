"""Bloom (ALiBi: a per-head linear bias added by ``baddbmm`` to the scores) trains.

``baddbmm``'s meta function expands its broadcast ``[batch x heads, 1, seq]`` bias through the int-only
``expand`` kernel, so the training re-trace on symbolic sizes failed (``boomfx analyze bloom.pt2 --train``
ended in an internal error); it now runs under the Python dispatcher, as ``pad`` does
(``training/checkpointing.py: SIZE_READING_CPP_KERNELS``). Truth: the profiler's peak of a real CPU
AdamW step of the same export (``tests/test_cpu_memory_accuracy.py``'s protocol), within 1%.
"""
from __future__ import annotations

import pytest
import torch

from boomfx.core.program import ProgramOptions
from test_cpu_memory_accuracy import TOLERANCE, predicted_peak, real_peak


@pytest.mark.slow  # export of a transformers model
def test_bloom_training_peak_matches_the_profiler(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from torch.export import Dim

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, use_cache=False)
    model = transformers.BloomForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 16))
    ep = torch.export.export(model, (ids,), strict=False,
                             dynamic_shapes=({0: Dim("batch", max=64), 1: Dim("seq", min=2, max=64)},))
    predicted, _ = predicted_peak(ep, (ids,), ProgramOptions(True, "adamw", target_kind="cpu"), str(tmp_path / "cpu.db"))
    real = real_peak(ep, (ids,), True, loss="cross_entropy", foreach=None)   # torch's AdamW default: the loop
    assert real > 0 and abs(predicted - real) <= TOLERANCE * real, (predicted, real, predicted / real - 1)
