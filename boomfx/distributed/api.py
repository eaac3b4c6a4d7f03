"""``boomfx.analyze``: the single-device entry point plus ``parallel=`` (per-rank programs).

It sits above the analysis layer (boomfx/analysis/analysis.py:analyze does one device), so the
analysis never imports the distributed package it is used by.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from boomfx.analysis.analysis import AnalyzeOptions
from boomfx.analysis.analysis import analyze as analyze_one_device
from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import OptionError
from boomfx.core.program import ProgramOptions
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.plan import ParallelConfig
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.report.model import Report


def analyze(
    source: Any, *example_inputs: Any, parallel: Any = None, rank: Optional[int] = None, **options: Any
) -> Report:
    """``boomfx.analysis.analysis.analyze(source, *example_inputs, **options)``, or with ``parallel``
    (``"dp_shard=8"``, a ``ParallelConfig`` or a dict of its fields; needs ``train=True``) the worst
    rank's Report (``rank=`` another's) with ``report.parallel`` holding every rank class; ``batch`` is
    then per data-parallel rank.

    Example::

        >>> r = boomfx.analyze("llama.pt2", train=True, parallel="dp_shard=8", batch=2, seq=4096)
        >>> r.parallel["worst_rank"], r.parallel["classes"][0]["peak_reserved_bytes"]
    """
    if parallel is None:
        if rank is not None:
            raise OptionError("rank= needs parallel=")
        return analyze_one_device(source, *example_inputs, **options)
    started = time.perf_counter()
    if not options.get("train"):
        raise OptionError("parallel= needs train=True (the per-rank programs are training steps)")
    cfg = ParallelConfig.from_mapping(parallel)
    device = options.pop("device", "a100-80gb")
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    dims, batch, seq = options.pop("dims", None), options.pop("batch", None), options.pop("seq", None)
    analyze_options = AnalyzeOptions(
        spec.name,
        options.pop("alloc_conf", ""),
        options.pop("outside_memory", ""),
        options.pop("db", None),
        options.pop("from_db", None),
    )
    program_options = {k: options.pop(k) for k in list(options) if k in ProgramOptions.__dataclass_fields__}
    compile_ = program_options.get("compile", False) or program_options.get("cudagraphs", False)
    program_options["compile"] = compile_
    capture_kwargs = {k: options.pop(k) for k in ("dynamic_shapes", "log") if k in options}
    if options:
        raise OptionError(f"analyze: unknown options {sorted(options)}")
    program = capture(
        source,
        *example_inputs,
        options=ProgramOptions(target_kind=spec.kind, **program_options),
        **capture_kwargs,
    )
    bindings = resolve_bindings(program, dims or {}, batch, seq)
    report = DistributedAnalysis(program, cfg, spec, analyze_options).evaluate(bindings, rank=rank).report
    report.analysis_seconds = time.perf_counter() - started
    return report
