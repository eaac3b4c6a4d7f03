"""Capture: turn whatever the user has (.pt2 path, ExportedProgram, module + inputs, GraphModule) into a Program.

The graph is never run: sizes stay symbolic, parameters are meta tensors. ``--train`` / ``--amp`` /
``--checkpoint`` / ``--checkpoint-layers`` re-trace the exported graph on fake tensors (see
``boomfx.training.trace``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from boomfx.core.errors import BoomfxError, DimError, OptionError
from boomfx.frontend.foreign import refuse_retrace_of_stand_ins
from boomfx.frontend.torch_caches import fx_source_keys, release_when_collected
from boomfx.core.program import (
    EAGER_PROGRAM,
    ROLE_BUFFER, ROLE_CONSTANT, ROLE_INPUT, ROLE_PARAM, Program, ProgramOptions, SymbolInfo,
)
from boomfx.frontend.loader import archive_key
from boomfx.frontend.symbols import symbols_of
from boomfx.frontend.trace_cache import cached_trace, keep_trace, trace_key
from boomfx.passes.eager_grouped_mm import eager_grouped_products, has_cpu_grouped_mm
from boomfx.passes.eager_sdpa import eager_attention_calls, eager_attention_export, traces_eager_attention

__all__ = ["capture", "resolve_bindings", "export_roles", "export_param_names", "symbols_of", "program_from_traced",
           "to_exported_program", "load_exported", "trace_step", "export_of", "validate_options", "OPTIMIZERS", "AMP_DTYPES"]

OPTIMIZERS = ("sgd", "adam", "adamw", "none")   # none: forward + backward only (a micro-batch step)
DEFAULT_OPTIMIZER = "adamw"
AMP_DTYPES = ("bf16", "fp16")
NO_OPTIMIZER = "none"


def validate_options(options: ProgramOptions) -> None:
    if options.optimizer not in OPTIMIZERS:
        raise OptionError(f"unknown optimizer '{options.optimizer}' (choose from {', '.join(OPTIMIZERS)})")
    if options.amp is not None and options.amp not in AMP_DTYPES:
        raise OptionError(f"unknown --amp value '{options.amp}' (choose from {', '.join(AMP_DTYPES)})")
    if options.cudagraphs and not options.compile:  # compiled execution (passes/compiled.py)
        raise OptionError("--cudagraphs needs --compile (CUDA graphs are torch.compile's reduce-overhead mode)")
    if options.checkpoint and not options.train:
        raise OptionError("--checkpoint needs --train (activation checkpointing only changes training)")
    if options.checkpoint_layers and not options.train:
        raise OptionError("--checkpoint-layers needs --train (activation checkpointing only changes training)")
    if options.resident_grads and not options.train:
        raise OptionError("--resident-grads needs --train (gradients exist only in training)")
    if options.stack_depth is not None and (not options.train or options.stack_depth < 4):
        raise OptionError(f"stack_depth={options.stack_depth}: a synthesised depth needs train=True and at least 4 layers")


def load_exported(path: str | os.PathLike, log: Optional[Callable[[str], None]] = None) -> ExportedProgram:
    """Load a .pt2 file safely (no unpickling, no imports of the file's classes)."""
    from boomfx.frontend.loader import load_program
    return load_program(path, verbose=log is not None, log=log)


def to_exported_program(source: Any, example_inputs: Sequence[Any] = (),
                        dynamic_shapes: Any = None, log: Optional[Callable[[str], None]] = None) -> ExportedProgram:
    if isinstance(source, ExportedProgram):
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_exported(source, log)
    if isinstance(source, torch.nn.Module) and not isinstance(source, torch.fx.GraphModule):
        if not example_inputs:
            raise BoomfxError("an nn.Module needs example inputs to be exported")
        return torch.export.export(source, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=False)
    raise BoomfxError(f"cannot analyse an object of type {type(source).__name__}")


def export_roles(ep: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> role, from the export's graph signature."""
    kinds = {
        InputKind.PARAMETER: ROLE_PARAM, InputKind.BUFFER: ROLE_BUFFER, InputKind.USER_INPUT: ROLE_INPUT,
        InputKind.CONSTANT_TENSOR: ROLE_CONSTANT, InputKind.CUSTOM_OBJ: ROLE_CONSTANT, InputKind.TOKEN: ROLE_CONSTANT,
    }
    return {spec.arg.name: kinds.get(spec.kind, ROLE_INPUT) for spec in ep.graph_signature.input_specs
            if hasattr(spec.arg, "name")}


def export_param_names(ep: ExportedProgram) -> dict[str, str]:
    return {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs
            if spec.target is not None and hasattr(spec.arg, "name")}


def capture(source: Any, *example_inputs: Any, options: ProgramOptions = ProgramOptions(),
            dynamic_shapes: Any = None, log: Optional[Callable[[str], None]] = None) -> Program:
    """Build a Program from a .pt2 path, an ExportedProgram, an nn.Module (+ inputs) or a GraphModule."""
    validate_options(options)
    sources_before = fx_source_keys()
    program = _capture(source, *example_inputs, options=options, dynamic_shapes=dynamic_shapes, log=log)
    if options.runs_eager_module:   # no causal mask and unrepeated KV heads, as transformers calls SDPA eagerly
        program = eager_attention_calls(program)
    if options.target_kind == "cpu" and options.runs_eager_module and has_cpu_grouped_mm():
        # the experts' products the eager model calls, not the fallback its export traced (passes/eager_grouped_mm.py)
        program = eager_grouped_products(program)
    if options.compile:  # compiled execution: rewrite into the kernels Inductor runs (passes/compiled.py)
        from boomfx.passes.compiled import compile_program
        eager = program
        program = compile_program(program)
        program.derived[EAGER_PROGRAM] = eager   # per-rank rewrites start from it (boomfx/distributed/ranks.py)
    # what torch's process-wide caches keep of this capture goes with the program (boomfx/torch_caches.py)
    release_when_collected(program.gm, fx_source_keys() - sources_before)
    return program


def _capture(source: Any, *example_inputs: Any, options: ProgramOptions = ProgramOptions(),
             dynamic_shapes: Any = None, log: Optional[Callable[[str], None]] = None) -> Program:
    if isinstance(source, torch.fx.GraphModule):
        if options.train or options.amp:
            raise OptionError("--train/--amp need an ExportedProgram, a .pt2 file or a module; got a GraphModule")
        from boomfx.frontend.graphmodule import program_from_graph_module
        found = program_from_graph_module(source, example_inputs)
        if isinstance(found, Program):
            return found
        return _capture(found, options=options, log=log)   # the GraphModule, exported
    ep = to_exported_program(source, example_inputs, dynamic_shapes, log)
    label = str(source) if isinstance(source, (str, os.PathLike)) else type(source).__name__
    roles = export_roles(ep)
    symbols = symbols_of(ep, roles)
    if not options.train and not options.amp and not has_recurrent_layers(ep):
        # (the export kept: tensor-parallel serving shards it)
        return Program(ep.graph_module, symbols, roles, options, param_names=export_param_names(ep), source=label,
                       export=ep)
    refuse_retrace_of_stand_ins(ep, "--train" if options.train else "--amp" if options.amp else "a recurrent layer")
    # transformers' eager attention calls (trace_step): kept once per export graph, so found again there at once
    eager_attention = traces_eager_attention(options) and eager_attention_export(ep, symbols, roles) is not ep
    key = trace_key(archive_key(ep), options, eager_attention)
    program = cached_trace(key, options, label)
    if program is not None:
        if log is not None:
            log(f"reused the step traced earlier from the same archive content under the same options ({label})")
    else:
        program = program_from_traced(trace_step(ep, options), symbols, options, label)
        keep_trace(key, program)
    if options.train:   # the per-rank tensor-parallel rewrite re-traces it (boomfx/distributed)
        program = dataclasses.replace(program, export=ep)
    return program


def has_recurrent_layers(ep: ExportedProgram) -> bool:
    """An export holding ``aten.lstm``/``gru``/``rnn_*`` calls: one node for a whole recurrent layer stack,
    which eager PyTorch runs as oneDNN's LSTM primitive per layer or ATen's loop of per-step cell ops.
    Re-traced (an inference step too), they become those kernels (torch's decompositions, as eager picks
    them: ``training/recurrent.py``), priced and allocated one by one like every other kernel."""
    from boomfx.training.recurrent import RNN_OPS
    return any(node.target in RNN_OPS for node in ep.graph.nodes)


def trace_step(ep: Any, options: ProgramOptions) -> Any:
    """The re-traced step of ``ep`` under ``options`` (a ``training.TracedProgram``); ``ep`` may be the
    duck-typed export a rewrite builds (what ``training._trace`` reads). As the nn.Module runs eagerly
    (``traces_eager_attention``), traced from ``ep`` with transformers' eager SDPA calls (passes/eager_sdpa.py):
    no causal mask, the key/value heads unrepeated, in the forward and so in the backward and its saved tensors."""
    from boomfx.training import trace as training
    if traces_eager_attention(options):
        roles = export_roles(ep)
        ep = eager_attention_export(ep, symbols_of(ep, roles), roles)
    if options.train:
        # depth-free: trace 4 layers and replicate (boomfx/training/truncate.py); None -> full trace
        # (not without an optimizer or with its per-parameter loop: the synthesis extends foreach lists)
        from boomfx.training.truncate import build_training_program_fast
        traced = None
        if options.optimizer != NO_OPTIMIZER and options.uses_foreach:
            traced = build_training_program_fast(
                ep, optimizer=options.optimizer, amp=options.amp, checkpoint=options.checkpoint,
                fused_attention=options.target_kind == "cuda", checkpoint_layers=options.checkpoint_layers,
                resident_grads=options.resident_grads, param_dtype=options.param_dtype, loss=options.loss,
                depth=options.stack_depth)
        if traced is None:
            traced = training.build_training_program(ep, optimizer=options.optimizer, amp=options.amp,
                                                     checkpoint=options.checkpoint,
                                                     fused_attention=options.target_kind == "cuda",
                                                     checkpoint_layers=options.checkpoint_layers,
                                                     resident_grads=options.resident_grads,
                                                     param_dtype=options.param_dtype, loss=options.loss,
                                                     foreach=options.uses_foreach)
        return traced
    return training.build_inference_program(ep, amp=options.amp, fused_attention=options.target_kind == "cuda")


def export_of(program: Program) -> Optional[ExportedProgram]:
    """The export a ``program`` was captured from (None for rewritten or compiled programs)."""
    return program.export


def program_from_traced(traced: Any, symbols: Mapping[str, SymbolInfo], options: ProgramOptions,
                        source: str = "<memory>") -> Program:
    """Wrap a ``training.TracedProgram`` (a re-traced step) as a Program with the export's symbols."""
    gm = _rename_symbols(traced.gm, traced.symbol_map)
    return Program(gm, symbols, dict(traced.input_roles), options, phases=dict(traced.phases),
                   grad_nodes=dict(getattr(traced, "grad_nodes", {}) or {}), param_names=dict(traced.param_names),
                   source=source)


def _rename_symbols(gm: torch.fx.GraphModule, symbol_map: Mapping[sympy.Symbol, sympy.Symbol]) -> torch.fx.GraphModule:
    """Record the symbol map on the graph module so passes translate traced symbols to exported ones."""
    gm.meta["boomfx.symbol_map"] = {k: v for k, v in symbol_map.items() if k != v}
    return gm


def resolve_bindings(program: Program, dims: Mapping[str, int], batch: Optional[int] = None,
                     seq: Optional[int] = None, allow_unbound: bool = False) -> dict[sympy.Symbol, int]:
    """Bind symbols by symbol (``s77``), by another name (the export's Dim name, ``input_ids.1``), by role
    (``batch``/``seq``), or via --batch/--seq; check ranges."""
    bindings: dict[sympy.Symbol, int] = {}
    requests = dict(dims)
    if batch is not None:
        requests["batch"] = batch
    if seq is not None:
        requests["seq"] = seq
    for name, value in requests.items():
        try:
            info = program.symbol(name)
        except KeyError:
            if name in ("batch", "seq"):
                if not program.symbols:
                    continue  # a static export: --batch/--seq have nothing to bind, the shapes are fixed
                raise DimError(f"no symbol of the program could be identified as {name}; bind it with --dim "
                               f"NAME=VALUE (symbols: {_describe(program)})") from None
            raise DimError(f"unknown dimension '{name}' (valid names: {_describe(program) or 'none, the export is static'})") from None
        value = int(value)
        if value < info.min_value or (info.max_value is not None and value > info.max_value):
            raise DimError(f"{name}={value} is outside the exported range of {info.describe()}")
        bindings[info.symbol] = value
    unbound = [info for info in program.symbols.values() if info.symbol not in bindings]
    if unbound and not allow_unbound:
        names = "; ".join(info.describe() for info in unbound)
        raise DimError(f"unbound symbolic dimension(s): {names}; bind with --dim NAME=VALUE, --batch or --seq")
    return bindings


def _describe(program: Program) -> str:
    return ", ".join(info.describe() for info in program.symbols.values())
