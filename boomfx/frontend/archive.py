"""Read a ``torch.export.save`` archive (.pt2) with ``zipfile``, never with pickle.

Why: ``torch.export.load`` unpickles sample inputs and pickled constants, so loading an untrusted
file can run arbitrary code. boomfx only needs the graph JSON and the *shapes* of weights and
constants, so this module reads exactly those JSON records and builds meta tensors from their
``tensor_meta``; it never reads weight bytes and never calls ``torch.load``.

Archive layout (torch 2.9-2.14, ``torch/_C/_export/pt2_archive_constants``), all entries under one
top-level folder named after the file::

    <root>/archive_format                              "pt2"
    <root>/archive_version                             "0"
    <root>/models/model.json                           serialized ExportedProgram
    <root>/data/weights/model_weights_config.json      fqn -> path_name, tensor_meta, is_param
    <root>/data/constants/model_constants_config.json  fqn -> path_name, tensor_meta
    <root>/data/sample_inputs/model.pt                 pickle (skipped)

Known limitations:
- Legacy (torch <= 2.7) archives and pickled custom objects are refused with ``LoadError``.
- Weights whose recorded shape is symbolic are refused (never produced by ``torch.export``).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from boomfx.core.errors import BoomfxError

ARCHIVE_FORMAT_VALUE = "pt2"
ARCHIVE_VERSION_VALUE = "0"
MODEL_NAME = "model"
MODEL_JSON = f"models/{MODEL_NAME}.json"
WEIGHTS_DIR = "data/weights/"
CONSTANTS_DIR = "data/constants/"
WEIGHTS_CONFIG = f"{WEIGHTS_DIR}{MODEL_NAME}_weights_config.json"
CONSTANTS_CONFIG = f"{CONSTANTS_DIR}{MODEL_NAME}_constants_config.json"
TENSOR_CONSTANT_PREFIX = "tensor_"
ZIP_DIRECTORY = "the zip directory"   # named by errors about the container rather than one entry


class LoadError(BoomfxError):
    """A .pt2 file that boomfx cannot load; ``str(err)`` is one sentence naming the file and cause."""


@dataclass(frozen=True)
class ArchiveContents:
    """What boomfx reads from a .pt2: parsed JSON only, plus record sizes (no payload bytes)."""

    path: str
    program: dict[str, Any]
    weights_config: dict[str, Any]
    constants_config: dict[str, Any]
    record_sizes_bytes: dict[str, int]
    digest: str = ""   # sha256 of the JSON records and record sizes: the same digest, the same graph


def _root_prefix(names: list[str], path: str) -> str:
    """Return the top-level folder (with trailing '/') that holds ``archive_format``."""
    for name in names:
        if name == "archive_format" or name.endswith("/archive_format"):
            return name[: -len("archive_format")]
    if any(n == "version" or n.endswith("/version") for n in names) and not any(
        "/models/" in n for n in names
    ):
        raise LoadError(f"{path} has no archive_format entry: a legacy (torch <= 2.7) export archive, which "
                        "boomfx does not read.")
    raise LoadError(f"{path} is a zip file but not a torch.export .pt2 archive (no archive_format record).")


def _parse_json(data: bytes, name: str, path: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise LoadError(f"{path} is corrupt: {name} is not valid JSON ({str(e)[:200]}).") from e


def read_archive(path: str | os.PathLike) -> ArchiveContents:
    """Read the graph JSON and payload configs of a .pt2 file; raise ``LoadError`` if unusable."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LoadError(f"{path} does not exist.")
    if not os.path.isfile(path):
        raise LoadError(f"{path} is not a file.")
    try:
        is_zip = zipfile.is_zipfile(path)
    except zipfile.BadZipFile as e:   # a damaged end record can raise instead of answering False
        raise LoadError(f"{path} is a corrupt zip archive: {ZIP_DIRECTORY} cannot be read ({e}).") from e
    if not is_zip:
        raise LoadError(f"{path} is not a .pt2 file (not a zip archive).")
    reading = ZIP_DIRECTORY  # what a corrupt-zip error is about: the directory, then each entry read
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            prefix = _root_prefix(names, path)

            def read(entry: str) -> bytes:
                nonlocal reading
                reading = entry
                return zf.read(prefix + entry)

            fmt = read("archive_format").decode("utf-8", "replace").strip()
            if fmt != ARCHIVE_FORMAT_VALUE:
                raise LoadError(f"{path}: its archive_format entry is {fmt!r}, not {ARCHIVE_FORMAT_VALUE!r}.")
            if prefix + "archive_version" in names:
                version = read("archive_version").decode("utf-8", "replace").strip()
                if version != ARCHIVE_VERSION_VALUE:
                    raise LoadError(
                        f"{path}: its archive_version entry is {version!r}; boomfx reads version {ARCHIVE_VERSION_VALUE!r}."
                    )
            if prefix + MODEL_JSON not in names:
                raise LoadError(f"{path} is corrupt: it has no {MODEL_JSON} record.")
            digest = hashlib.sha256()
            raw = {entry: read(entry) if prefix + entry in names else b"{}"
                   for entry in (MODEL_JSON, WEIGHTS_CONFIG, CONSTANTS_CONFIG)}
            for data in raw.values():
                digest.update(len(data).to_bytes(8, "little") + data)
            program = _parse_json(raw[MODEL_JSON], MODEL_JSON, path)
            weights = _parse_json(raw[WEIGHTS_CONFIG], WEIGHTS_CONFIG, path)
            consts = _parse_json(raw[CONSTANTS_CONFIG], CONSTANTS_CONFIG, path)
            reading = ZIP_DIRECTORY
            sizes = {
                info.filename[len(prefix) :]: info.file_size
                for info in zf.infolist()
                if info.filename.startswith(prefix + "data/")
            }
    except LoadError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, KeyError, ValueError) as e:
        raise LoadError(f"{path} is a corrupt zip archive: {reading} cannot be read ({type(e).__name__}: {e}).") from e
    if not isinstance(program, dict) or "graph_module" not in program:
        raise LoadError(f"{path} is corrupt: {MODEL_JSON} does not describe an exported program.")
    digest.update(repr(sorted(sizes.items())).encode())
    return ArchiveContents(path, program, _config(weights, WEIGHTS_CONFIG, path), _config(consts, CONSTANTS_CONFIG, path),
                           sizes, digest.hexdigest())


def _config(doc: Any, entry: str, path: str) -> dict[str, Any]:
    """The ``config`` object (fqn -> payload) of a payload config entry."""
    config = doc.get("config", {}) if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise LoadError(f"{path} is corrupt: {entry} config is not an object of fqn -> payload.")
    return config


# ---------------------------------------------------------------------------------------------
# Meta state dict: shapes and dtypes only, aliasing preserved through a shared meta base per file.
# ---------------------------------------------------------------------------------------------


def _int_list(values: list[dict[str, Any]], what: str, path: str) -> list[int]:
    out = []
    for v in values:
        if "as_int" not in v:
            raise LoadError(f"{path} has a {what} with a symbolic size, which boomfx does not support.")
        out.append(int(v["as_int"]))
    return out


def _dtype(code: int) -> torch.dtype:
    from torch._export.serde.schema import ScalarType
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    return _SERIALIZE_TO_TORCH_DTYPE[ScalarType(code)]


def _extent(sizes: list[int], strides: list[int], offset: int) -> int:
    """Number of storage elements a strided view touches (0 for an empty tensor)."""
    if any(s == 0 for s in sizes):
        return 0
    return offset + sum((n - 1) * st for n, st in zip(sizes, strides)) + 1


def meta_tensors(
    config: dict[str, Any], base_dir: str, record_sizes_bytes: dict[str, int], path: str, *, constants: bool
) -> dict[str, torch.Tensor]:
    """Build meta tensors from a payload config; entries sharing a non-empty file share one storage.

    Pickled payloads are described by their ``tensor_meta`` when it is present and refused otherwise,
    so no object named by the file is ever unpickled.
    """
    parsed: dict[str, tuple[str, torch.dtype, list[int], list[int], int, dict[str, Any]]] = {}
    base_numel: dict[str, int] = {}
    entry = f"{base_dir}{MODEL_NAME}_{'constants' if constants else 'weights'}_config.json"
    for fqn, payload in config.items():
        name = payload.get("path_name", "")
        meta = payload.get("tensor_meta")
        if constants and not name.startswith(TENSOR_CONSTANT_PREFIX):
            raise LoadError(
                f"{path} holds a pickled custom object constant {fqn!r} ({entry}), which boomfx refuses to unpickle."
            )
        if meta is None:
            raise LoadError(f"{path} holds a pickled payload {fqn!r} without tensor metadata ({entry}); boomfx does not unpickle it.")
        try:
            dtype = _dtype(meta["dtype"])
            sizes = _int_list(meta["sizes"], f"weight ({entry} {fqn})", path)
            strides = _int_list(meta["strides"], f"weight ({entry} {fqn})", path)
            offset = int(meta.get("storage_offset", {"as_int": 0}).get("as_int", 0))
        except (KeyError, ValueError, TypeError) as e:
            raise LoadError(f"{path} is corrupt: {entry} has bad tensor metadata for {fqn!r} ({e}).") from e
        record_numel = record_sizes_bytes.get(base_dir + name, 0) // max(1, dtype.itemsize)
        # A shared record with data means shared storage (tied weights). Meta exports write every
        # tensor to one empty record (meta tensors have no storage to tell apart), so an empty
        # record gives each tensor its own storage rather than aliasing the whole model.
        key = name if record_numel > 0 and not payload.get("use_pickle") else f"<own>{fqn}"
        parsed[fqn] = (key, dtype, sizes, strides, offset, payload)
        base_numel[key] = max(base_numel.get(key, 0), _extent(sizes, strides, offset), record_numel)
    bases: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for fqn, (key, dtype, sizes, strides, offset, payload) in parsed.items():
        requires_grad = bool(payload["tensor_meta"].get("requires_grad", False))
        try:
            if key not in bases:
                bases[key] = torch.empty(base_numel[key], dtype=dtype, device="meta")
            tensor = torch.as_strided(bases[key], sizes, strides, offset)
            if payload.get("is_param"):
                tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        except (RuntimeError, ValueError, OverflowError, TypeError) as e:
            # sizes no tensor can have (numel overflows), a parameter of an integer dtype needing grad
            raise LoadError(f"{path} is corrupt: {entry} describes {fqn!r} as no tensor can be "
                            f"({str(e).splitlines()[0][:200]}).") from e
        out[fqn] = tensor
    return out
