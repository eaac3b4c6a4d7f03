"""Loss parallelism: cross-entropy on vocabulary-split logits, as DTensor's ``loss_parallel()`` runs it.

torchtitan's default with tensor parallelism: the output head is ``ColwiseParallel(output_layouts=
Shard(-1), use_local_output=False)`` and the loss runs under ``loss_parallel()``, so each rank keeps
its ``[tokens, vocab / tp]`` logits and no rank ever holds the whole vocabulary's. What one rank runs
(torch 2.13's ``torch/distributed/tensor/parallel/loss.py``, ``reduction="mean"``, ``ignore_index=-100``):

- log-softmax over the split vocabulary: the local ``amax`` all-reduced with MAX, ``x - max``, the
  local ``sum(exp(...))`` all-reduced with SUM, ``shifted - log(sumexp)`` (the log-probabilities, saved
  for backward, in the logits' dtype);
- nll: the labels masked to this rank's vocabulary block (``MaskPartial``: a label outside it reads
  row 0 and its value is zeroed), ``gather``, the picked log-probabilities all-reduced with SUM, their
  mean over the labels not ignored;
- backward, with no collective (the ``nll_loss_backward`` handler does log-softmax's backward too):
  ``zeros_like(logp)`` with ``mask - 1`` put at each label, ``(that + exp(logp)) * grad / count``.

The three all-reduces are ``[tokens, 1]``; the head's input gradient is still all-reduced by the
colwise linear's backward (``tp_ops.region_enter``). ``boomfx_tp::reduce`` stands for each reduction
and ``tp_ops.lower_tp_ops`` turns it into ``_c10d_functional.all_reduce`` + ``wait_tensor``.

The tensor-parallel rewrite (``tensor_parallel.shard_export``) hands ``vocab_parallel_cross_entropy``
to the training trace on the sharded export (``cross_entropy``), which calls it in place of
``F.cross_entropy``. A masked label's row index is set with ``masked_fill_`` where DTensor indexes with
the boolean mask (``x[mask] = 0``): the same tensors, in place either way.
"""

from __future__ import annotations

import torch

from boomfx.distributed import tp_ops  # noqa: F401  (registers boomfx_tp::reduce)

IGNORE_INDEX = -100  # F.cross_entropy's default


def _reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    return torch.ops.boomfx_tp.reduce(x, op)


def _local_ids(ids: torch.Tensor, rows: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``MaskPartial._mask_tensor``: (which ids lie outside this rank's ``rows``, the ids shifted into
    the block with those set to 0). The trace stands for rank 0 (offset 0): same shapes on every rank."""
    outside = (ids < offset) | (ids >= offset + rows)
    local = ids.clone() - offset
    local.masked_fill_(outside, 0)
    return outside, local


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = logits.to(torch.float32, memory_format=torch.contiguous_format)
        x_max = _reduce(torch.amax(x, 1, keepdim=True), "max")
        shifted = x - x_max
        sumexp = _reduce(torch.sum(torch.exp(shifted), 1, keepdim=True), "sum")
        logp = (shifted - torch.log(sumexp)).to(logits.dtype)
        kept = labels != IGNORE_INDEX
        safe = torch.where(kept, labels, 0).unsqueeze(1)
        outside, local = _local_ids(safe, logp.shape[1])
        picked = torch.gather(logp, 1, local)
        picked.masked_fill_(outside, 0)
        result = -_reduce(picked, "sum").squeeze(1)
        result = torch.where(kept, result, 0)
        total = kept.sum().to(logp)
        ctx.save_for_backward(logp, labels, total)
        return result.sum() / total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        logp, labels, total = ctx.saved_tensors
        grad = grad / total
        target = labels.unsqueeze(1)
        safe = torch.where(target != IGNORE_INDEX, target, 0)
        grad_input = torch.zeros_like(logp)
        outside, local = _local_ids(safe.squeeze(1).flatten(), logp.shape[1])
        update = outside.to(grad_input.dtype) - 1.0
        rows = torch.arange(local.shape[0], device=local.device)
        grad_input[rows, local] = update
        grad = torch.where(target != IGNORE_INDEX, grad, 0)
        return (grad_input + torch.exp(logp)) * grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[tokens, vocab / tp]`` logits against ``[tokens]`` labels of the whole
    vocabulary, one TP rank's part of ``loss_parallel()``."""
    return _VocabParallelCrossEntropy.apply(logits, labels)
