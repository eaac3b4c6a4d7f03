"""Seeded mutations of .pt2 archives, to check that damaged files fail with one line, never a traceback.

Why: a user's file may be truncated by a download, edited by hand, or written by another torch
version. boomfx must refuse what it cannot read with a ``LoadError`` naming the archive entry, and
must never turn an inconsistent file into a silently wrong number. This module makes damaged copies
of a good archive the ways files get damaged; ``benchmarks/fuzz_archive.py`` and
``tests/test_fuzz_archive.py`` feed them to the CLI.

Mutation kinds (``KINDS``), each applied once per mutant:

- ``json-change``: one JSON value of an archive entry replaced by a plausible value of the same
  type (an integer from elsewhere in the file, +-1, 0, -1, a huge one; another string of the file;
  a list with an element dropped, duplicated or the order shuffled; a flipped bool);
- ``json-delete``: one dict key or list element removed;
- ``json-retype``: one value replaced by a value of another JSON type;
- ``entry-drop``: one zip entry removed;
- ``entry-truncate``: one entry cut at a random length;
- ``entry-flip``: 1-8 bits flipped inside one entry (re-zipped, so the CRC is right);
- ``zip-flip``: 1-8 bits flipped anywhere in the zip file (the CRC or a header may catch it).

Only ``random.Random`` and the standard library are used: mutant ``i`` of seed ``s`` is the same on
every machine. Written for boomfx (no code copied from other fuzzers).
"""
from __future__ import annotations

import io
import json
import random
import zipfile
from dataclasses import dataclass
from typing import Any

KINDS = ("json-change", "json-delete", "json-retype", "entry-drop", "entry-truncate", "entry-flip", "zip-flip")
# How often each kind is drawn: the JSON mutations reach the deserializer and the analysis, where the
# interesting failures are; the zip-level ones mostly stop at the CRC and cost little.
KIND_WEIGHTS = (4, 2, 2, 1, 1, 1, 1)
_OTHER_TYPE_VALUES: tuple[Any, ...] = (None, 0, -1, 1.5, "x", "", True, [], [0], {}, {"as_int": 1})
_HUGE_INT = 2**62


@dataclass(frozen=True)
class Mutant:
    """One damaged archive: how it was made and its bytes."""

    kind: str
    entry: str        # the zip entry changed ("" for zip-flip)
    detail: str       # where inside the entry, and what was done
    data: bytes


def read_entries(archive: bytes) -> list[tuple[str, bytes]]:
    """The archive's entries in order, as (name, content)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return [(info.filename, zf.read(info)) for info in zf.infolist()]


_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write_entries(entries: list[tuple[str, bytes]]) -> bytes:
    """A stored (uncompressed) zip of ``entries``, as ``torch.export.save`` writes.

    Every entry carries one fixed timestamp: ``writestr`` with a bare name stamps the current time,
    so two runs of the same seed a second apart would give different bytes.
    """
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name, content in entries:
            zf.writestr(zipfile.ZipInfo(name, date_time=_FIXED_TIME), content)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------
# JSON values: every location in a document, and what a changed value may be.
# ---------------------------------------------------------------------------------------------


def _locations(doc: Any) -> list[tuple[Any, Any, str]]:
    """Every (container, key, path) of a JSON document (the root is not one)."""
    found: list[tuple[Any, Any, str]] = []
    stack = [(doc, "")]
    while stack:
        node, where = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            path = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"
            found.append((node, key, path))
            if isinstance(value, (dict, list)):
                stack.append((value, path))
    return found


def _scalars(doc: Any) -> tuple[list[int], list[str]]:
    ints: list[int] = []
    strs: list[str] = []
    for container, key, _ in _locations(doc):
        value = container[key]
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            ints.append(value)
        elif isinstance(value, str):
            strs.append(value)
    return ints, strs


def _changed(value: Any, rng: random.Random, ints: list[int], strs: list[str]) -> Any:
    """A different value of the same JSON type (a plausible edit, not a random blob)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        choices = [value + 1, value - 1, 0, -1, 2 * value + 1, _HUGE_INT, -_HUGE_INT]
        if ints:
            choices += [rng.choice(ints)] * 3
        return rng.choice([c for c in choices if c != value] or [value + 1])
    if isinstance(value, float):
        return rng.choice([float("nan"), float("inf"), -value, 0.0, value * 2 + 1])
    if isinstance(value, str):
        choices = ["", value + "x", value[: len(value) // 2]]
        if strs:
            choices += [rng.choice(strs)] * 3
        return rng.choice([c for c in choices if c != value] or [value + "x"])
    if isinstance(value, list):
        if not value:
            return [rng.choice(_OTHER_TYPE_VALUES)]
        out = list(value)
        action = rng.randrange(3)
        i = rng.randrange(len(out))
        if action == 0:
            del out[i]
        elif action == 1:
            out.insert(i, out[i])
        else:
            rng.shuffle(out)
        return out
    if isinstance(value, dict):
        if not value:
            return {"x": 0}
        out = dict(value)
        old = rng.choice(list(out))
        out[old + "_"] = out.pop(old)    # a renamed key
        return out
    return rng.choice([0, "", {}])


def _retyped(value: Any, rng: random.Random) -> Any:
    choices = [v for v in _OTHER_TYPE_VALUES if type(v) is not type(value)]
    return rng.choice(choices)


def _mutate_json(content: bytes, kind: str, rng: random.Random) -> tuple[bytes, str] | None:
    try:
        doc = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    locations = _locations(doc)
    if not locations:
        return None
    container, key, path = rng.choice(locations)
    old = container[key]
    if kind == "json-delete":
        del container[key]
        what = "deleted"
    elif kind == "json-retype":
        container[key] = _retyped(old, rng)
        what = f"retyped to {container[key]!r}"
    else:
        ints, strs = _scalars(doc)
        container[key] = _changed(old, rng, ints, strs)
        what = f"changed to {json.dumps(container[key])[:60]}"
    return json.dumps(doc).encode("utf-8"), f"{path[:120]} ({type(old).__name__}) {what}"


def _flip_bits(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if not data:
        return data, "empty"
    out = bytearray(data)
    positions = []
    for _ in range(rng.randint(1, 8)):
        pos = rng.randrange(len(out))
        out[pos] ^= 1 << rng.randrange(8)
        positions.append(pos)
    return bytes(out), f"bits flipped at bytes {sorted(positions)}"


# ---------------------------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------------------------


def mutate(archive: bytes, rng: random.Random) -> Mutant:
    """One mutant of ``archive`` (kind drawn by ``KIND_WEIGHTS``); deterministic for a seeded ``rng``."""
    entries = read_entries(archive)
    kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    if kind == "zip-flip":
        data, detail = _flip_bits(archive, rng)
        return Mutant(kind, "", detail, data)
    if kind.startswith("json-"):
        json_entries = [i for i, (name, _) in enumerate(entries) if name.endswith(".json")]
        # the graph (models/model.json) is most of the file and most of what can go wrong
        weights = [4 if entries[i][0].endswith("models/model.json") else 1 for i in json_entries]
        index = rng.choices(json_entries, weights=weights)[0]
        name, content = entries[index]
        mutated = _mutate_json(content, kind, rng)
        if mutated is not None:
            entries[index] = (name, mutated[0])
            return Mutant(kind, name, mutated[1], write_entries(entries))
        kind = "entry-flip"
    index = rng.randrange(len(entries))
    name, content = entries[index]
    if kind == "entry-drop":
        del entries[index]
        detail = "dropped"
    elif kind == "entry-truncate":
        cut = rng.randrange(len(content)) if content else 0
        entries[index] = (name, content[:cut])
        detail = f"truncated to {cut} of {len(content)} bytes"
    else:
        flipped, detail = _flip_bits(content, rng)
        entries[index] = (name, flipped)
    return Mutant(kind, name, detail, write_entries(entries))


def mutant(archive: bytes, seed: int, index: int) -> Mutant:
    """Mutant number ``index`` of the stream seeded by ``seed`` (independent of the other indices)."""
    return mutate(archive, random.Random(f"{seed}:{index}"))
