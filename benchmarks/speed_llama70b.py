"""How fast is ``boomfx analyze`` on Llama-70B-shaped exports, against ``torch.export.load`` alone?

Targets (from the project plan):
  1. 80-layer ``analyze --train`` end to end <= 0.5x the time of ``torch.export.load`` of the same file;
  2. 80-layer analysis <= 2x the 8-layer analysis (cost must not grow with depth: repeated blocks are
     priced once);
  3. an 18-point sweep (batch x seq) <= 2x one single-point analysis.

Exports are built from ``transformers.LlamaConfig`` on the meta device (no weight data), with dynamic
batch and sequence, and cached under ``benchmarks/.cache/`` because the 80-layer export takes minutes.
Every timing runs in a fresh subprocess so no stage profits from caches warmed by another. A stage
that fails is recorded with its error; the script itself does not crash.

Usage::

    python benchmarks/speed_llama70b.py                  # 8 and 80 layers
    python benchmarks/speed_llama70b.py --layers 8       # quick run
    python benchmarks/speed_llama70b.py --export-only    # only build the cached exports

Writes ``benchmarks/results/speed_llama70b.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
CACHE_DIR = HERE / ".cache"

# Llama-2-70B shapes; only the layer count varies.
LLAMA_70B_SHAPE = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
DEVICE = "h100-sxm"
BATCH, SEQ = 1, 2048
SWEEP = ("batch=1,2,4,8,16,32", "seq=1024,2048,4096")      # 6 x 3 = 18 points
STAGE_TIMEOUT_S = 1800


def export_llama(num_layers: int, path: Path) -> None:
    """Export a meta-device Llama of ``num_layers`` layers to ``path`` (dynamic batch and seq)."""
    import torch
    from torch.export import Dim
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=num_layers, use_cache=False, **LLAMA_70B_SHAPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    input_ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    dynamic_shapes = {"input_ids": {0: Dim("batch"), 1: Dim("seq", min=2)}}
    ep = torch.export.export(model, (), {"input_ids": input_ids}, dynamic_shapes=dynamic_shapes, strict=False)
    tmp = path.with_suffix(".tmp.pt2")
    torch.export.save(ep, tmp)
    os.replace(tmp, path)


def cached_export(num_layers: int) -> tuple[Path, Optional[float]]:
    """The cached export for ``num_layers`` and the seconds it took to build it now (None: cached)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"llama70b_{num_layers}l.pt2"
    if path.exists():
        return path, None
    print(f"exporting {num_layers}-layer model to {path} ...", flush=True)
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "import speed_llama70b as b; b.export_llama(int(sys.argv[1]), Path(sys.argv[2]))")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(num_layers), str(path), str(HERE)], check=True)
    return path, time.perf_counter() - start
