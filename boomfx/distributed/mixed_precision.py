"""FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: the program the ranks compute with.

Why a re-trace: under ``param_dtype=bfloat16`` FSDP all-gathers bf16 copies of the fp32 shards and
runs forward and backward on them, so every activation, saved tensor and gradient is bf16 (not the
fp32 program with casts in front of matmuls that ``--amp``'s autocast gives). The training step is
traced again with its parameters in ``param_dtype`` (``ProgramOptions.param_dtype``,
``boomfx.training.amp.ComputeDtypePolicy``); the FSDP rewrite (fsdp.py) then gives the resident
shards and the optimizer the parameters' own dtype and reduce-scatters in ``reduce_dtype``.

The dtypes are clamped as ``FSDPParam.init_dtype_attrs`` does (torch 2.13): ``param_dtype`` equal to
the parameters' dtype means no cast, ``reduce_dtype`` equal to ``param_dtype`` means none either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from boomfx.core.errors import OptionError
from boomfx.core.program import ROLE_PARAM, Program
from boomfx.distributed.plan import DTYPES, ParallelConfig


@dataclass(frozen=True)
class MixedPrecision:
    """The clamped policy: ``master`` is the parameters' own dtype (None: no mixed precision)."""

    master: Optional[torch.dtype] = None
    param: Optional[torch.dtype] = None  # None: compute in the master dtype
    reduce: Optional[torch.dtype] = None  # None: reduce-scatter in the gradients' dtype


def torch_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The torch dtype of an ``--fsdp-param-dtype``/``--fsdp-reduce-dtype`` value (None: not given)."""
    return getattr(torch, DTYPES[name]) if name is not None else None


def _parameters_dtype(program: Program) -> torch.dtype:
    """The (floating) parameters' dtype as exported; FSDP needs one per unit, here one per model."""
    dtypes = {n.meta["val"].dtype for n in program.graph.nodes
              if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_PARAM
              and n.meta["val"].is_floating_point()}
    if len(dtypes) > 1:
        raise OptionError(f"--fsdp-param-dtype: the parameters have several dtypes ({sorted(map(str, dtypes))}); "
                          f"FSDP's mixed precision needs one")
    return dtypes.pop() if dtypes else torch.float32


def policy(program: Program, cfg: ParallelConfig) -> MixedPrecision:
    """``cfg``'s mixed-precision policy for ``program``'s parameters, clamped as FSDP2 clamps it."""
    if cfg.fsdp_param_dtype is None and cfg.fsdp_reduce_dtype is None:
        return MixedPrecision()
    if program.options.amp:
        raise OptionError("--fsdp-param-dtype/--fsdp-reduce-dtype with --amp: FSDP's mixed precision replaces "
                          "autocast (torchtitan uses one or the other); give one")
    master = _parameters_dtype(program)
    param = torch_dtype(cfg.fsdp_param_dtype)
    if param == master:
        param = None
    reduce = torch_dtype(cfg.fsdp_reduce_dtype)
    if reduce == (param or master):
        reduce = None
    if param is None and reduce is None:
        return MixedPrecision()
    return MixedPrecision(master, param, reduce)


def compute_program(program: Program, mp: MixedPrecision) -> Program:
    """``program`` traced again with its parameters in ``mp.param`` (cached on the program)."""
    if mp.param is None:
        return program
    name = str(mp.param).removeprefix("torch.")
    if program.options.param_dtype == name:
        return program
    key = ("param_dtype", name)
    if key not in program.derived:
        from boomfx.frontend.capture import export_of, program_from_traced, trace_step

        ep = export_of(program)
        if ep is None or not program.options.train:
            raise OptionError("--fsdp-param-dtype needs the training program captured from its export "
                              "(boomfx.frontend.capture.capture with train=True)")
        # every rank rewrite starts from the foreach step (ranks.foreach_step)
        options = dataclasses.replace(program.options, param_dtype=name, foreach=True)
        traced = program_from_traced(trace_step(ep, options), program.symbols, options, program.source)
        program.derived[key] = dataclasses.replace(traced, export=ep, warnings=program.warnings, derived={})
    return program.derived[key]
