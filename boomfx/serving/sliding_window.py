"""Read each attention layer's sliding window off the mask the export builds for it.

A sliding-window layer (Mistral, or Gemma-2/3's alternating local layers) differs from a full one
only in its mask: query ``q`` may see keys ``q - W + 1 .. q``. Mask constructions differ between
models and library versions (``kv_idx > q_idx - W`` comparisons, ``triu``/``tril`` bands, additive
``-inf`` masks), so the mask is not pattern-matched: its subgraph is *run* on a concrete input of
``probe_tokens`` tokens (token ids and attention masks all ones: masks depend on positions and
padding, not on token values) and the last query's row is read: it sees ``min(W, probe_tokens)``
keys. Fewer than all keys means a window of that many tokens.

Known limitations:
- NB: a window at least as long as the probe (``MAX_PROBE_TOKENS``, or the export's sequence range
  when shorter) is not seen; ``--sliding-window N`` gives it (a window that long never
  drops a token of a request shorter than the probe anyway).
- NB: a mask that depends on a parameter or a buffer is not run (its layers count as full
  attention unless ``--sliding-window`` is given).
"""
from __future__ import annotations

from typing import Mapping, Optional

import sympy
import torch
import torch.fx

from boomfx.core.program import Program
from boomfx.passes.mask_probe import run_mask, visible


def window_of_mask(mask: torch.Tensor) -> Optional[int]:
    """Keys the last query sees, when that is fewer than all keys (``None``: full attention)."""
    if mask.dim() < 2 or mask.shape[-1] < 2:
        return None
    row = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0, -1]
    allowed = visible(row)
    seen = int(allowed.sum())
    return seen if 0 < seen < row.numel() else None


def probe_windows(program: Program, masks: Mapping[str, torch.fx.Node], bindings: Mapping[sympy.Symbol, int]
                  ) -> dict[str, Optional[int]]:
    """Each distinct mask node's window (keyed by SDPA node name); masks shared by layers run once."""
    by_mask: dict[str, Optional[int]] = {}
    out: dict[str, Optional[int]] = {}
    for sdpa, mask in masks.items():
        if mask.name not in by_mask:
            with torch.no_grad():
                value = run_mask(program, mask, bindings)
            by_mask[mask.name] = window_of_mask(value) if value is not None else None
        out[sdpa] = by_mask[mask.name]
    return out
