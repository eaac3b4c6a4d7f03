"""The losses ``--train`` can reduce a model's output to (torch-free: the CLI parser lists them).

``boomfx/training/trace.py`` (``_loss_of``, ``token_logits``) traces them; ``boomfx/validate/real_step.py``
runs the same ones for real.
"""
from __future__ import annotations

# "auto": the output itself when it is a scalar; cross-entropy against next-token labels when the
# program takes labels or returns a language model's logits; else the mean of the first output
LOSSES = ("auto", "cross_entropy", "mean", "output")
