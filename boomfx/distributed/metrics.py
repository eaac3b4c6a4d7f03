"""The numbers people compare distributed runs by: step time, tokens/s per GPU, MFU, exposed and hidden
communication, bubble fraction.

MFU follows torchtitan (``torchtitan/models/utils.py:get_dense_model_nparams_and_flops``) and Megatron-LM's
``num_floating_point_operations``: model FLOPs per token for a training step (forward + backward)

    6 * N + 12 * L * H * Q * T

with N the parameters outside the embeddings (an embedding is a lookup, no matmul), L layers, H attention
heads, Q the head dimension, T the sequence length: ``6 N`` is 2 FLOPs per weight per token forward and 4
backward; ``12 L H Q T`` the attention scores and weighted sum (2 matmuls of ``2 T H Q`` per token forward,
x3 with backward), with no causal halving, as both report it. For a GPT layer (``N = 12 L h^2``, ``H Q = h``)
this is Megatron's ``72 B s L h^2 (1 + s / (6 h))`` per batch ``B`` of ``s`` tokens (without its vocabulary
term, which torchtitan leaves out too). Activation recomputation adds work but not model FLOPs (MFU, not
HFU). The peak is the device's dense peak for the training dtype (``DeviceSpec.peak_for``).

    MFU = model FLOPs per step / (step time x world x peak FLOP/s per GPU)

Example::

    >>> per_token = model_flops_per_token(6.5e9, 32, 32, 128, 4096)   # a Llama-2-7B-sized model
    >>> round(mfu(per_token * 4096 * 8, step_ns=1e9, world=8, peak_flops_per_s=989.4e12), 3)
    0.188
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import OptionError
from boomfx.simulate.pipeline import PipelineTimeline
from boomfx.simulate.streams import StreamTimeline

NS_PER_S = 1e9


def model_flops_per_token(non_embedding_params: float, layers: int, heads: int, head_dim: int, seq: int,
                          training: bool = True) -> float:
    """``6 N + 12 L H Q T`` for training (forward + backward), a third of it for a forward alone."""
    if min(layers, heads, head_dim, seq) < 0 or non_embedding_params < 0:
        raise OptionError("model FLOPs need non-negative parameters, layers, heads, head_dim and seq")
    forward_and_backward = 6.0 * non_embedding_params + 12.0 * layers * heads * head_dim * seq
    return forward_and_backward if training else forward_and_backward / 3.0


def mfu(model_flops_per_step: float, step_ns: float, world: int, peak_flops_per_s: float) -> float:
    """Model FLOPs per second per GPU over the GPU's dense peak."""
    if step_ns <= 0 or world < 1 or peak_flops_per_s <= 0:
        raise OptionError(f"MFU needs a positive step time, world and peak (got {step_ns}, {world}, "
                          f"{peak_flops_per_s})")
    return model_flops_per_step / (step_ns / NS_PER_S) / world / peak_flops_per_s


@dataclass(frozen=True)
class DistributedMetrics:
    step_ns: float
    tokens_per_step: int                  # the global batch x sequence length
    tokens_per_s_per_gpu: float
    model_flops_per_step: float
    mfu: float
    exposed_comm_ns: float
    hidden_comm_ns: float
    bubble_fraction: float

    def to_dict(self) -> dict:
        return dict(vars(self))


def step_metrics(step_ns: float, world: int, global_batch: int, seq: int, flops_per_token: float,
                 device: DeviceSpec, dtype: torch.dtype = torch.bfloat16, streams: Optional[StreamTimeline] = None,
                 pipeline: Optional[PipelineTimeline] = None) -> DistributedMetrics:
    """Every metric of one step of ``world`` GPUs training ``global_batch`` sequences of ``seq`` tokens."""
    tokens = int(global_batch) * int(seq)
    flops = flops_per_token * tokens
    return DistributedMetrics(
        step_ns=step_ns, tokens_per_step=tokens,
        tokens_per_s_per_gpu=tokens / (step_ns / NS_PER_S) / world,
        model_flops_per_step=flops, mfu=mfu(flops, step_ns, world, device.peak_for(dtype)),
        exposed_comm_ns=streams.exposed_comm_ns if streams is not None else 0.0,
        hidden_comm_ns=streams.hidden_comm_ns if streams is not None else 0.0,
        bubble_fraction=pipeline.bubble_fraction if pipeline is not None else 0.0)
