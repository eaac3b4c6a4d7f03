"""Load a ``torch.export`` .pt2 file safely and quickly, for analysis only.

Why not ``torch.export.load``: it unpickles sample inputs and constants (unsafe on untrusted
files), fails on output containers from packages that are not imported (e.g. ``transformers``),
and spends seconds re-parsing the same symbolic shape strings. boomfx needs the graph, the fake
values on its nodes and the shapes of weights, nothing more.

Steps:
1. ``archive.read_archive``: zip + JSON only, weights and constants as meta tensors.
2. ``validate.check_program_json`` / ``check_payload_configs``: the JSON checked against torch's
   export schema and for references that resolve; a damaged file stops here with a ``LoadError``
   naming the entry and the field.
3. ``treespec.sanitize_program``: unknown pytree types become plain dicts/tuples;
   ``foreign.replace_foreign_ops``: custom ops this process has not registered become stand-ins
   with the schema their calls imply (priced by bytes moved, listed as unmodelled).
4. ``deserialize.deserialize_fast``: torch's graph deserializer with cached schema conversion and
   memoized symbol parsing. If it fails for any reason, ``deserialize.deserialize_torch`` (torch's
   unpatched deserializer, still fed only JSON and meta tensors) is tried, and the log says why.
5. ``graph_check.check_graph``: the loaded graph's shapes must fit together (weights vs
   placeholders, each ATen call re-run on its recorded inputs), so an edited size is refused rather
   than analysed into a wrong number.
6. ``ties.apply_ties``: tied weights (shared records, or for meta exports the graph's structure)
   become one tensor with one fake storage again, as they are in memory.

Example::

    from boomfx.frontend.loader import load_program
    ep = load_program("llama.pt2", verbose=True)
    print(ep.graph_module.graph)

Known limitations:
- Only the program named ``model`` is read (what ``torch.export.save`` writes).
- ``ep.example_inputs`` is ``None`` (sample inputs are pickles) and the state dict holds meta
  tensors, so the program can be analysed or re-traced on meta but not run on real data.
- Pickled custom objects (torchbind, opaque objects) are refused with ``LoadError``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Optional

import torch

from boomfx.frontend import deserialize as pt2_fast
from boomfx.frontend.foreign import replace_foreign_ops
from boomfx.frontend.archive import CONSTANTS_DIR, MODEL_JSON, WEIGHTS_DIR, LoadError, meta_tensors, read_archive
from boomfx.frontend.graph_check import check_graph
from boomfx.frontend.treespec import sanitize_program
from boomfx.frontend.ties import apply_ties
from boomfx.frontend.validate import check_payload_configs, check_program_json

__all__ = ["LoadError", "load_program"]

_log = logging.getLogger(__name__)


def _make_logger(verbose: bool, log: Callable[[str], None] | None) -> Callable[[str], None]:
    if log is not None:
        return log
    if verbose:
        return lambda msg: print(f"[boomfx.frontend.loader] {msg}", file=sys.stderr)
    return _log.debug


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def load_program(
    path: str | os.PathLike,
    verbose: bool = False,
    log: Callable[[str], None] | None = None,
) -> torch.export.ExportedProgram:
    """Load the ``ExportedProgram`` saved in ``path`` without unpickling or importing user code.

    Args:
        path: a file written by ``torch.export.save``.
        verbose: print which loading path was used (and why) to stderr.
        log: receives those messages instead of stderr when given.

    Returns:
        An ``ExportedProgram`` whose graph matches ``torch.export.load`` (targets, names,
        ``meta["val"]`` fake tensors with the same symbols, ``nn_module_stack``, range
        constraints); parameters, buffers and constants are meta tensors.

    Raises:
        LoadError: missing file, not a .pt2 archive, corrupt archive or JSON, unsupported schema
            version, pickled custom objects, or a graph neither deserializer can read.
    """
    say = _make_logger(verbose, log)
    start = time.perf_counter()
    contents = read_archive(path)
    name = contents.path
    check_program_json(contents.program, name)
    check_payload_configs(contents.weights_config, contents.constants_config, name, contents.program)
    replaced = sanitize_program(contents.program)
    if replaced:
        say(f"replaced unregistered pytree types by plain containers: {', '.join(sorted(set(replaced)))}")
    foreign = replace_foreign_ops(contents.program, name)
    if foreign:
        say(f"custom ops not registered in this process, loaded as stand-ins (bytes moved only): {', '.join(foreign)}")
    state_dict = meta_tensors(contents.weights_config, WEIGHTS_DIR, contents.record_sizes_bytes, name, constants=False)
    constants = meta_tensors(contents.constants_config, CONSTANTS_DIR, contents.record_sizes_bytes, name, constants=True)
    _check_version(contents.program, name)

    try:
        program = pt2_fast.fast_dict_to_dataclass(contents.program)
        ep = pt2_fast.deserialize_fast(program, state_dict, constants)
    except Exception as err:  # noqa: BLE001  any failure of the fast path -> exact torch path
        fast_error = err
    else:
        say(f"loaded {name} with the fast path in {time.perf_counter() - start:.2f} s")
        return _checked(ep, name, (contents.digest, tuple(foreign), "fast"), say)
    say(f"fast path failed ({_short(fast_error)}); falling back to torch's deserializer")
    try:
        ep = pt2_fast.deserialize_torch(contents.program, state_dict, constants)
    except Exception as err:  # noqa: BLE001
        raise LoadError(f"{name}: {MODEL_JSON} could not be deserialized ({_short(err)}).") from err
    say(f"loaded {name} with torch's deserializer in {time.perf_counter() - start:.2f} s")
    return _checked(ep, name, (contents.digest, tuple(foreign), "torch"), say)


def _checked(ep: torch.export.ExportedProgram, name: str, key: tuple,
             say: Callable[[str], None]) -> torch.export.ExportedProgram:
    _check_graph_once(ep, name, key)
    _ARCHIVE_KEYS[ep] = key
    return _tied(ep, say)


# the content key of every ExportedProgram this loader returned (while it lives)
_ARCHIVE_KEYS: "weakref.WeakKeyDictionary[torch.export.ExportedProgram, tuple]" = weakref.WeakKeyDictionary()


def archive_key(ep: torch.export.ExportedProgram) -> Optional[tuple]:
    """(archive digest, stand-in ops, deserializer) of an ExportedProgram ``load_program`` read, else None:
    two loads of the same bytes have the same key (``frontend/trace_cache.py`` reuses traces by it)."""
    return _ARCHIVE_KEYS.get(ep)


# (archive digest, stand-in ops, deserializer) of every graph that passed ``check_graph`` in this process
_CHECKED_GRAPHS: set[tuple] = set()


def _check_graph_once(ep: torch.export.ExportedProgram, name: str, key: tuple) -> None:
    """``check_graph`` once per archive content: it re-runs every distinct op on fake tensors (4.7 s of
    a 5.7 s load for a small Mixtral), and a library user who analyses one file under several options,
    or a sweep, loads the same bytes again and again. The key holds which ops were stand-ins (one
    registered later loads as itself) and which deserializer read it."""
    if key in _CHECKED_GRAPHS:
        return
    check_graph(ep, name)
    _CHECKED_GRAPHS.add(key)


def _tied(ep: torch.export.ExportedProgram, say: Callable[[str], None]) -> torch.export.ExportedProgram:
    """A file does not record that tied weights share one fake storage: restore it (``boomfx.ties``)."""
    for kept, *others in apply_ties(ep):
        say(f"tied weights counted once: {kept} = {', '.join(others)}")
    return ep


def _check_version(program: dict, path: str) -> None:
    """Refuse schema versions torch's deserializer refuses, before any graph work."""
    version = program.get("schema_version") or {}
    major, minor = version.get("major"), version.get("minor")
    if not isinstance(major, int) or not isinstance(minor, int):
        raise LoadError(f"{path} is corrupt: {MODEL_JSON} has no schema_version.")
    supported = pt2_fast.serde.SCHEMA_VERSION
    if major != supported[0] and (major, minor) != (0, 0):
        raise LoadError(
            f"{path} uses export schema version {major}.{minor} ({MODEL_JSON} schema_version), but this torch reads "
            f"{supported[0]}.x (schema {supported[0]}.{supported[1]})."
        )
