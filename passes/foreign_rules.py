"""Shape rules and backwards for the few library ops whose semantics are public, so their stand-ins re-run.

Why: ``--train`` and ``--amp`` re-run every op on fake tensors (``boomfx/training/trace.py``). A stand-in
(``passes/foreign_ops.py``) has neither a shape rule nor a backward, so a Mixtral exported with
``transformers``' default experts (``transformers::grouped_mm_fallback``, one ``mm`` per expert) could not
be trained from the command line, which never imports ``transformers``. Its semantics are public and
small (``transformers/integrations/moe.py``): the output is ``[S, N]`` for input ``[S, K]`` and weight
``[E, K, N]``, and its autograd formula calls a second custom op,
``transformers::grouped_mm_fallback_backward(input, weight, offs, grad_output) -> (grad_input,
grad_weight)``, shaped like ``input`` and ``weight``. A rule here gives the stand-in that shape rule and
that backward (the backward op as a stand-in of its own), so the re-traced step holds the nodes it holds
with ``transformers`` imported, priced by the same grouped-matmul formula (``passes/costs/grouped_mm.py``).

A rule applies only to the exact schema it was written for: another version of the library (another
signature) stays a plain stand-in and is refused by a re-trace, as before.

Example::

    rule = RERUN_RULES[("transformers::grouped_mm_fallback", "default",
                        "(Tensor input, Tensor weight, Tensor offs) -> Tensor")]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class RerunRule:
    """How a stand-in is re-run: its shape rule, and optionally autograd's context and backward.

    ``backward(ctx, *grads, define)`` receives ``define(qualified, overload, signature)``, which returns
    the stand-in of another op of the library (a backward op), so this module needs nothing above it.
    """

    fake: Callable[..., Any]
    setup_context: Optional[Callable[[Any, tuple, Any], None]] = None
    backward: Optional[Callable[..., Any]] = None


_GROUPED_MM = "(Tensor input, Tensor weight, Tensor offs) -> Tensor"
_GROUPED_MM_BACKWARD = "(Tensor input, Tensor weight, Tensor offs, Tensor grad_output) -> (Tensor, Tensor)"


def _grouped_mm_fake(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``[S, K] x [E, K, N] -> [S, N]`` in the input's dtype (transformers' fake kernel)."""
    return input.new_empty(input.shape[0], weight.shape[2])


def _grouped_mm_backward_fake(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                              grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(input), torch.empty_like(weight)


def _grouped_mm_setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    """Saves input and weight, as transformers does; ``offs`` is an integer tensor (no gradient)."""
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _grouped_mm_backward(ctx: Any, grad_output: torch.Tensor, *, define: Callable[..., Any]) -> tuple:
    input, weight = ctx.saved_tensors
    backward_op = define("transformers::grouped_mm_fallback_backward", "default", _GROUPED_MM_BACKWARD)
    grad_input, grad_weight = backward_op(input, weight, ctx.offs, grad_output)
    return grad_input, grad_weight, None


# (qualified name, overload, signature as the file's calls imply it) -> rule
RERUN_RULES: dict[tuple[str, str, str], RerunRule] = {
    ("transformers::grouped_mm_fallback", "default", _GROUPED_MM):
        RerunRule(_grouped_mm_fake, _grouped_mm_setup_context, _grouped_mm_backward),
    ("transformers::grouped_mm_fallback_backward", "default", _GROUPED_MM_BACKWARD):
        RerunRule(_grouped_mm_backward_fake),
}
