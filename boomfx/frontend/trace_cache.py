"""The last few re-traced training / autocast steps, per archive content and options, in this process.

Re-tracing a step on fake tensors is the slow part of an analysis (10 s for a small Mixtral, most of it
torch's symbolic-shape arithmetic); binding batch and sequence, pricing and the allocator replay are
not. A library user, the pytest plugin over a suite, or a sweep analyse the same file again and again
under other bindings, devices of one kind, memory budgets, or ``--compile`` (whose eager step is the
same trace): they reuse the step traced first.

The key is the archive's content (``loader.archive_key``: the digest of its records, the stand-in ops
and the deserializer, never the path or the file's time) and every option the trace reads
(``ProgramOptions`` without ``compile``/``cudagraphs``, which rewrite the traced step afterwards), and whether
the step is traced from the export with transformers' eager attention calls (``passes/eager_sdpa.py``: not
under ``compile``, so a compiled step shares the eager one's trace only where that rewrite changes nothing). In-memory
ExportedPrograms and modules are not cached: nothing says their graph is unchanged since the last call.

A hit returns a new Program that shares the traced GraphModule: passes never edit a Program's graph in
place (they rewrite a copy, ``Program.copied_graph``), and the new Program starts with no ``derived``
rewrites of its own. At most ``MAX_TRACES`` steps are kept (least recently used out), so a long
process that sees many models holds a bounded number of traces.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Hashable, Optional

from boomfx.core.program import Program, ProgramOptions

MAX_TRACES = 4

_TRACES: "OrderedDict[tuple, Program]" = OrderedDict()


def trace_key(content_key: Optional[Hashable], options: ProgramOptions, eager_attention: bool = False) -> Optional[tuple]:
    """What a traced step depends on: the archive content, the options the trace reads and whether it is traced
    from the export rewritten with transformers' eager attention calls (None: not cacheable)."""
    if content_key is None:
        return None
    return (content_key, dataclasses.replace(options, compile=False, cudagraphs=False), eager_attention)


def cached_trace(key: Optional[tuple], options: ProgramOptions, source: str) -> Optional[Program]:
    """The step traced earlier under ``key``, as a new Program with ``options`` and ``source``; or None."""
    if key is None or key not in _TRACES:
        return None
    _TRACES.move_to_end(key)
    return dataclasses.replace(_TRACES[key], options=options, source=source, derived={})


def keep_trace(key: Optional[tuple], program: Program) -> None:
    """Remember ``program`` (a freshly traced step) under ``key``, dropping the least recently used beyond MAX_TRACES."""
    if key is None:
        return
    _TRACES[key] = dataclasses.replace(program, derived={})
    _TRACES.move_to_end(key)
    while len(_TRACES) > MAX_TRACES:
        _TRACES.popitem(last=False)


def clear_traces() -> None:
    """Forget every kept step (their graphs are freed once no Program holds them)."""
    _TRACES.clear()
