"""Hand-made damage to the shipped mlp.pt2 (x[B, 64] -> linear 256 -> relu -> linear 256 -> relu -> linear 10):
each is refused with a LoadError that names the archive entry and the field or node, and the CLI prints
that one line (exit 2). The seeded mutants are tests/test_fuzz_archive.py."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from boomfx.cli.main import main
from boomfx.frontend.loader import LoadError, load_program

MODEL = "models/model.json"
WEIGHTS = "data/weights/model_weights_config.json"
CONSTANTS = "data/constants/model_constants_config.json"


def _edit(src: Path, dst: Path, entry: str, change: Callable[[Any], Any]) -> Path:
    """Copy ``src`` with the JSON entry ``entry`` (below the root folder) edited in place by ``change``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.split("/", 1)[1] == entry:
                doc = json.loads(data)
                change(doc)
                data = json.dumps(doc).encode()
            zout.writestr(info.filename, data)
    return dst


def _graph(doc: dict) -> dict:
    return doc["graph_module"]["graph"]


def _set(obj: dict, key: str, value: Any) -> None:
    obj[key] = value


CASES = [
    # (entry, edit, words the message must hold)
    (CONSTANTS, lambda d: _set(d, "config", "x"), [CONSTANTS, "config is not an object"]),
    (WEIGHTS, lambda d: d["config"]["fc1.weight"]["tensor_meta"]["strides"].pop(),
     [WEIGHTS, "config.fc1.weight.tensor_meta", "2 sizes but 1 strides"]),
    (WEIGHTS, lambda d: _set(d["config"]["fc2.bias"]["tensor_meta"], "dtype", 99),
     [WEIGHTS, "config.fc2.bias.tensor_meta.dtype", "ScalarType"]),
    (MODEL, lambda d: _set(_graph(d)["nodes"][0]["inputs"][2], "name", "biasx"),
     [MODEL, "graph_module.graph.nodes[0].inputs", "'biasx'", "aten.linear.default"]),
    (MODEL, lambda d: _set(_graph(d)["nodes"][1]["inputs"][0]["arg"]["as_tensor"], "name", "nope"),
     [MODEL, "graph_module.graph.nodes[1].inputs[0].arg", "'nope'"]),
    (MODEL, lambda d: _set(_graph(d)["nodes"][1]["inputs"][0], "arg", {"as_tensorx": {"name": "linear"}}),
     [MODEL, "graph_module.graph.nodes[1].inputs[0].arg has no field 'as_tensorx'"]),
    (MODEL, lambda d: _set(_graph(d)["tensor_values"]["relu"], "strides", [{"as_int": 256}]),
     [MODEL, "graph_module.graph.tensor_values.relu", "2 sizes but 1 strides"]),
    (MODEL, lambda d: _set(d["range_constraints"]["s77"], "min_val", 10**6),
     [MODEL, "range_constraints.s77", "min_val 1000000 > max_val"]),
    (MODEL, lambda d: _set(d["graph_module"]["module_call_graph"][0]["signature"], "out_spec", "not json"),
     [MODEL, "module_call_graph[0].signature.out_spec", "not a JSON tree spec"]),
]


@pytest.mark.parametrize("entry,edit,words", CASES, ids=[c[2][1][:40] for c in CASES])
def test_malformed_json_names_entry_and_field(tmp_path: Path, examples_dir: Path, entry, edit, words) -> None:
    path = _edit(examples_dir / "mlp.pt2", tmp_path / "bad.pt2", entry, edit)
    with pytest.raises(LoadError) as err:
        load_program(path)
    for word in words:
        assert word in str(err.value)


def _resize_fc1(doc: dict, rows: int) -> None:
    """fc1.weight [256, 64] -> [rows, 64] in one of the two places that record it."""
    meta = doc["config"]["fc1.weight"]["tensor_meta"] if "config" in doc else _graph(doc)["tensor_values"]["p_fc1_weight"]
    meta["sizes"][0] = {"as_int": rows}


def test_a_weight_missing_from_the_config_is_refused_naming_the_config(tmp_path: Path, examples_dir: Path) -> None:
    path = _edit(examples_dir / "mlp.pt2", tmp_path / "bad.pt2", WEIGHTS, lambda d: d["config"].pop("fc2.bias"))
    with pytest.raises(LoadError) as err:
        load_program(path)
    assert WEIGHTS in str(err.value) and "'fc2.bias'" in str(err.value)


def test_weight_config_disagreeing_with_its_placeholder_is_refused(tmp_path: Path, examples_dir: Path) -> None:
    path = _edit(examples_dir / "mlp.pt2", tmp_path / "bad.pt2", WEIGHTS, lambda d: _resize_fc1(d, 128))
    with pytest.raises(LoadError) as err:
        load_program(path)
    message = str(err.value)
    assert WEIGHTS in message and "'fc1.weight'" in message and "[128, 64]" in message and "[256, 64]" in message


def test_a_size_edited_everywhere_the_weight_is_recorded_is_caught_by_the_ops(tmp_path: Path,
                                                                             examples_dir: Path) -> None:
    # fc1.weight made [128, 64] in both the weights config and the graph: consistent payloads, but
    # linear(x[B, 64], W[128, 64]) + bias[256] cannot run (128 rows against a 256 bias)
    once = _edit(examples_dir / "mlp.pt2", tmp_path / "w.pt2", WEIGHTS, lambda d: _resize_fc1(d, 128))
    path = _edit(once, tmp_path / "bad.pt2", MODEL, lambda d: _resize_fc1(d, 128))
    with pytest.raises(LoadError) as err:
        load_program(path)
    message = str(err.value)
    assert "node linear (aten.linear.default) fails on its recorded inputs" in message
    assert "(128) must match the size of tensor b (256)" in message


def test_an_edited_intermediate_size_is_refused(tmp_path: Path, examples_dir: Path) -> None:
    # relu's output recorded as [B, 255]: relu of linear's [B, 256] gives [B, 256]
    def edit(d: dict) -> None:
        _graph(d)["tensor_values"]["relu"]["sizes"][1] = {"as_int": 255}
    path = _edit(examples_dir / "mlp.pt2", tmp_path / "bad.pt2", MODEL, edit)
    with pytest.raises(LoadError) as err:
        load_program(path)
    assert "node relu (aten.relu.default) as [8, 255]" in str(err.value)
    assert "its inputs give [8, 256]" in str(err.value)


def test_the_cli_prints_the_refusal_as_one_line(capsys, tmp_path: Path, examples_dir: Path) -> None:
    path = _edit(examples_dir / "mlp.pt2", tmp_path / "bad.pt2", CONSTANTS, lambda d: _set(d, "config", []))
    code = main(["analyze", str(path), "--batch", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("boomfx: error: ") and CONSTANTS in err


class _CacheWrite(torch.nn.Module):
    """A StaticCache-style step: the new row is written in place into a buffer, then read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 8, 4))
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(1, pos, self.proj(x))
        return self.cache.sum(1)


def test_an_in_place_buffer_write_loads_and_keeps_its_recorded_values(tmp_path: Path) -> None:
    # the check re-runs index_copy_ on the recorded values: under grad mode torch refuses an in-place
    # op on that leaf, and running it on the recorded value itself would edit the program's metadata
    ep = torch.export.export(_CacheWrite(), (torch.randn(2, 1, 4), torch.tensor([3])))
    path = tmp_path / "cache_write.pt2"
    torch.export.save(ep, path)
    program = load_program(path)
    cache = next(n for n in program.graph.nodes if n.op == "placeholder" and "cache" in n.name)
    assert list(cache.meta["val"].shape) == [2, 8, 4]
    copy = next(n for n in program.graph.nodes if n.op == "call_function" and "index_copy" in str(n.target))
    assert list(copy.meta["val"].shape) == [2, 8, 4]


def test_the_graph_check_runs_once_per_content_and_an_edit_in_place_is_still_caught(
        tmp_path: Path, examples_dir: Path, monkeypatch) -> None:
    """Re-running every op on fake tensors is most of a load, so a second load of the same bytes skips it;
    the same path rewritten with an inconsistent graph is new content and is refused."""
    import shutil

    import boomfx.frontend.loader as loader

    checked: list[str] = []
    real_check = loader.check_graph
    monkeypatch.setattr(loader, "check_graph", lambda ep, name: (checked.append(name), real_check(ep, name)))
    monkeypatch.setattr(loader, "_CHECKED_GRAPHS", set())
    path = tmp_path / "model.pt2"
    shutil.copy(examples_dir / "mlp.pt2", path)
    load_program(path)
    load_program(path)
    assert checked == [str(path)]
    edited = _edit(examples_dir / "mlp.pt2", tmp_path / "edited.pt2", MODEL,
                   lambda d: _set(_graph(d)["tensor_values"]["relu"]["sizes"][1], "as_int", 255))
    shutil.copy(edited, path)   # same path, same size class: only the content says it changed
    with pytest.raises(LoadError) as err:
        load_program(path)
    assert "node relu (aten.relu.default) as [8, 255]" in str(err.value)
    assert checked == [str(path)] * 2
