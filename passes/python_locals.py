"""Eager inference: what the model's Python keeps alive beyond a tensor's last use.

Why: the exported graph frees each value after its last use, and that is how ``ep.module()`` runs it
(FX's generated code drops each name). The ``nn.Module`` people run does not free that early. A tensor
bound to a local variable of a ``forward`` (or of a helper it calls) lives until that name is bound
again or the function returns. A function's arguments live until it returns, because the caller holds
them. Measured on transformers models (``benchmarks/cpu_accuracy.py``, ``tests/test_python_locals.py``),
the module's inference peak was 18-25% above the graph's: GPT-2, BERT and ViT.

Two rules, read off each node's ``stack_trace`` (the frames of the user's code; torch's own frames are
skipped) and ``nn_module_stack`` (which module instance a frame belongs to):

1. a statement ``name = ...`` (or ``a, b = ...``) binds its value, the last tensor its execution makes,
   in that frame. The value lives until the next statement of the same frame that binds one of those
   names has made its value, else until the frame's last op;
2. a frame's arguments, the tensors made before its first op and read by its ops, live until its last op.

Training programs are left as traced: autograd holds the forward's saved tensors anyway, and the
backward, where training steps peak, runs no user Python. Compiled programs are left as traced too:
Inductor's code frees at last use. ``ProgramOptions.python_locals=False`` (``--no-python-locals``) keeps
the graph's frees, which is what ``boomfx validate`` compares with, since it runs the export's graph.

Known limitations:
- a call that returns a tuple binds only the last tensor the call made;
- a tensor kept in an attribute or a container (``self.cache = x``, a list) is not followed;
- frames are told apart by their module instance, so a helper function that one module calls twice in
  one statement counts as one frame;
- only the first line of a multi-line statement is recorded, which is enough for the names it binds.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.fx

from boomfx.core.program import Program

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?:    ([^\n]*))?')
# "x = ...", "a, b = ...", "x: T = ..." (not "==", not "x += ...", not "self.x = ...")
_ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?::[^=]*)?=(?!=)")
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")
_TORCH_MODULES = "torch.nn.modules"

Frame = tuple[str, int, str, str]          # file, line, function, first line of the statement


def user_frames(node: torch.fx.Node) -> Optional[list[Frame]]:
    """The frames of the user's code that made ``node`` (outermost first), or None without a stack trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = [(f, int(line), fn, code or "") for f, line, fn, code in _FRAME.findall(trace)]
    return [fr for fr in frames if not _TORCH_FILE.search(fr[0])]


def _user_modules(node: torch.fx.Node) -> list[str]:
    """Module paths of the node's ``nn_module_stack`` whose forward is user code (torch.nn's own left out)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, kind in stack.values() if _TORCH_MODULES not in str(kind)]


def _frame_key(frames: list[Frame], modules: list[str], level: int) -> tuple:
    """One frame instance: its callers, its function, and the module instance it runs for (a ``forward``
    frame per user module, outermost first)."""
    forwards = sum(1 for f in frames[: level + 1] if f[2] == "forward")
    return tuple(frames[:level]), frames[level][0], frames[level][2], tuple(modules[:forwards])


def python_locals_held(info, program: Program):
    """``info`` (a ``passes.liveness.LivenessInfo``) with the storages the two rules hold extended."""
    if not program.options.runs_eager_module or not info.node_storages:
        return info
    step_of = {name: i for i, name in enumerate(info.order)}
    rows: list[tuple[torch.fx.Node, list[Frame], list[str]]] = []
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            frames = user_frames(node)
            if frames:
                rows.append((node, frames, _user_modules(node)))
    if not rows:
        return info
    frame_first: dict[tuple, int] = {}
    frame_last: dict[tuple, int] = {}
    reads: dict[tuple, set[int]] = {}
    bindings: list[tuple[tuple, list[str], int]] = []    # (frame, names bound, row of the value)
    for level in range(max(len(frames) for _, frames, _ in rows)):
        statement, names, last = None, None, -1
        for idx, (node, frames, modules) in enumerate(rows):
            here = None
            if level < len(frames):
                frame = _frame_key(frames, modules, level)
                frame_first.setdefault(frame, idx)
                frame_last[frame] = idx
                reads.setdefault(frame, set()).update(
                    s for a in node.all_input_nodes for s in info.node_storages.get(a.name, ()))
                # one execution of a statement: its callee's module instance tells loop iterations apart
                here = (frame, frames[level][1], tuple(modules[: len(frame[3]) + 1]))
                bound = _ASSIGN.match(frames[level][3])
            if here != statement:
                if names:
                    bindings.append((statement[0], names, last))
                statement = here
                names = [n.strip() for n in bound.group(1).split(",")] if here is not None and bound else None
            last = idx
        if names:
            bindings.append((statement[0], names, last))
    interval_of = {iv.storage_id: iv for iv in info.intervals if not iv.resident}
    new_end: dict[int, int] = {}

    def hold(storages, end_row: int) -> None:
        end = step_of[rows[end_row][0].name]
        for sid in storages:
            if sid in interval_of:
                new_end[sid] = max(new_end.get(sid, -1), end)

    for frame, storages in reads.items():          # rule 2: arguments live until the frame returns
        first = step_of[rows[frame_first[frame]][0].name]
        hold([s for s in storages if s in interval_of and interval_of[s].start_step < first], frame_last[frame])
    by_frame: dict[tuple, list[tuple[list[str], int]]] = {}
    for frame, names, row in sorted(bindings, key=lambda b: b[2]):
        by_frame.setdefault(frame, []).append((names, row))
    for frame, bound in by_frame.items():          # rule 1: a local lives until rebound or returned
        for k, (names, row) in enumerate(bound):
            release = next((later for later_names, later in bound[k + 1:] if set(names) & set(later_names)),
                           frame_last[frame])
            hold(info.node_storages.get(rows[row][0].name, ()), release)
    return info.extended(new_end)
