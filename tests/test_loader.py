"""Contract tests for ``boomfx.frontend.loader.load_program``: same graph as torch, no pickle, clear errors.

Every model is built and exported on the meta device inside the test, so no weights are allocated.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

from models import GPTBlock, MLP

from boomfx.frontend import deserialize as pt2_fast
from boomfx.frontend.loader import LoadError, load_program
from boomfx.frontend.treespec import sanitize_treespec

# ------------------------------------------------------------------------------------------------
# Models and helpers
# ------------------------------------------------------------------------------------------------


class TinyTransformer(nn.Module):
    """Kept local (examples/models.py's GPT has neither): a tied LM head and a registered buffer, which
    the loader must map to one shared storage and keep apart from the weights. Its blocks are examples'."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.register_buffer("pos", torch.zeros(64, width))
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2: one placeholder for both names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def export_to(path: Path, model: nn.Module, args: tuple, dynamic_shapes, strict: bool = True, kwargs=None) -> Path:
    """Export ``model`` (already on meta) and save it to ``path``."""
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    torch.export.save(ep, path)
    return path


def graph_summary(ep: torch.export.ExportedProgram) -> list[tuple]:
    """Everything an analysis reads from a node: op, name, target, args, fake shape/dtype, module path."""
    rows = []
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            val = (tuple(str(d) for d in val.shape), tuple(str(d) for d in val.stride()), val.dtype, str(val.device))
        else:
            val = str(val)
        rows.append((node.op, node.name, str(node.target), str(node.args), str(node.kwargs), val,
                     str(node.meta.get("nn_module_stack"))))
    return rows


def assert_same_program(ours: torch.export.ExportedProgram, theirs: torch.export.ExportedProgram) -> None:
    assert graph_summary(ours) == graph_summary(theirs)
    assert {str(k): str(v) for k, v in ours.range_constraints.items()} == {
        str(k): str(v) for k, v in theirs.range_constraints.items()
    }
    assert ours.graph_signature == theirs.graph_signature
    assert [e.fqn for e in ours.module_call_graph] == [e.fqn for e in theirs.module_call_graph]
    for name, tensor in theirs.state_dict.items():
        mine = ours.state_dict[name]
        assert mine.device.type == "meta"
        assert (tuple(mine.shape), mine.dtype, type(mine)) == (tuple(tensor.shape), tensor.dtype, type(tensor))
    assert set(ours.constants) == set(theirs.constants)


def rewrite_zip(src: Path, dst: Path, replace: dict[str, bytes | None], add: dict[str, bytes] | None = None) -> Path:
    """Copy a .pt2, replacing (or dropping, for None) records named by their path below the root folder."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        root = zin.namelist()[0].split("/")[0] + "/"
        for info in zin.infolist():
            rel = info.filename[len(root):]
            if rel in replace:
                if replace[rel] is not None:
                    zout.writestr(info.filename, replace[rel])
            else:
                zout.writestr(info.filename, zin.read(info.filename))
        for rel, data in (add or {}).items():
            zout.writestr(root + rel, data)
    return dst


def read_record(path: Path, rel: str) -> bytes:
    with zipfile.ZipFile(path) as z:
        root = z.namelist()[0].split("/")[0] + "/"
        return z.read(root + rel)


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    with torch.device("meta"):
        model = MLP(d_in=16, hidden=32, d_out=8)
    x = torch.empty(4, 16, device="meta")
    return export_to(tmp_path / "mlp.pt2", model, (x,), {"x": {0: Dim("batch")}})


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_hidden_layers=2, use_cache=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    path = tmp_path_factory.mktemp("llama") / "llama.pt2"
    return export_to(path, model, (), {"input_ids": {0: Dim("batch"), 1: Dim("seq", min=2)}},
                     strict=False, kwargs={"input_ids": ids})


# ------------------------------------------------------------------------------------------------
# Same graph as torch.export.load
# ------------------------------------------------------------------------------------------------


def test_mlp_matches_torch_load(mlp_file: Path) -> None:
    messages: list[str] = []
    ours = load_program(mlp_file, log=messages.append)
    assert_same_program(ours, torch.export.load(mlp_file))
    assert any("fast path" in m for m in messages)
    assert ours.example_inputs is None  # sample inputs are pickles: never read


def test_transformer_with_dynamic_batch_and_seq_matches_torch_load(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = TinyTransformer()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    path = export_to(tmp_path / "tiny.pt2", model, (ids,), {"ids": {0: Dim("batch"), 1: Dim("seq", min=2, max=64)}})
    ours, theirs = load_program(path), torch.export.load(path)
    assert_same_program(ours, theirs)
    symbols = {str(s) for s in ours.range_constraints}
    assert len(symbols) == 2
    sdpa = [n for n in ours.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2
    # (batch, heads, seq, head_dim) with the same symbols torch.export.load gives
    assert {str(d) for d in sdpa[0].meta["val"].shape[:3:2]} == symbols
    assert ours.range_constraints[sdpa[0].meta["val"].shape[2].node.expr].upper == 64
    # A meta export writes all weights to one empty record; they must not alias one storage,
    # or storage-keyed liveness would count the whole model as one tensor.
    sd = ours.state_dict
    assert sd["embed.weight"].untyped_storage()._cdata != sd["pos"].untyped_storage()._cdata
    assert sd["blocks.0.attn.weight"].untyped_storage()._cdata != sd["blocks.1.attn.weight"].untyped_storage()._cdata


def test_real_weight_export_loads_as_meta_and_keeps_tied_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyTransformer(layers=1)  # real CPU weights this time
    ids = torch.zeros(2, 8, dtype=torch.long)
    path = export_to(tmp_path / "cpu.pt2", model, (ids,), {"ids": {0: Dim("batch"), 1: Dim("seq", min=2, max=64)}})
    ours = load_program(path)
    assert_same_program(ours, torch.export.load(path))
    sd = ours.state_dict
    assert all(t.device.type == "meta" for t in sd.values())
    # head.weight is embed.weight: the shared record becomes one shared meta storage
    assert sd["embed.weight"].untyped_storage()._cdata == sd["head.weight"].untyped_storage()._cdata
    assert sd["embed.weight"].untyped_storage()._cdata != sd["pos"].untyped_storage()._cdata


def test_transformers_llama_matches_torch_load(llama_file: Path) -> None:
    ours, theirs = load_program(llama_file), torch.export.load(llama_file)
    assert_same_program(ours, theirs)
    stacks = [n.meta["nn_module_stack"] for n in ours.graph.nodes if n.op == "call_function"]
    assert any("model.layers.1.self_attn" in str(s) for s in stacks)


def test_transformers_export_loads_without_importing_transformers(llama_file: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        from boomfx.frontend.loader import load_program
        messages = []
        ep = load_program(sys.argv[1], log=messages.append)
        assert "transformers" not in sys.modules, "loading imported transformers"
        spec = ep.module_call_graph[0].signature.out_spec
        assert spec.type is dict and spec.context == ["logits"], spec
        assert any("CausalLMOutputWithPast" in m for m in messages), messages
        print(len(ep.graph.nodes))
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(llama_file)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 50


# ------------------------------------------------------------------------------------------------
# Safety: nothing named by the file is unpickled or imported
# ------------------------------------------------------------------------------------------------


class _CreatesMarker:
    """Unpickling this object creates (opens for writing) the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_sample_inputs_are_never_unpickled(mlp_file: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned_sample_inputs"
    evil = rewrite_zip(mlp_file, tmp_path / "evil.pt2",
                       {"data/sample_inputs/model.pt": pickle.dumps(_CreatesMarker(marker))})
    load_program(evil)
    assert not marker.exists()
    # The same file does run the payload under torch.export.load, so the test is meaningful.
    try:
        torch.export.load(evil)
    except Exception:  # noqa: BLE001  the payload returns a file object, which torch then rejects
        pass
    assert marker.exists()


def test_malicious_pickled_constant_is_never_unpickled(mlp_file: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned_constant"
    config = json.loads(read_record(mlp_file, "data/constants/model_constants_config.json"))
    meta = {"dtype": 7, "sizes": [{"as_int": 3}], "requires_grad": False, "device": {"type": "cpu", "index": None},
            "strides": [{"as_int": 1}], "storage_offset": {"as_int": 0}, "layout": 7}
    config["config"]["evil"] = {"path_name": "tensor_evil", "is_param": False, "use_pickle": True, "tensor_meta": meta}
    evil = rewrite_zip(
        mlp_file, tmp_path / "evil_const.pt2",
        {"data/constants/model_constants_config.json": json.dumps(config).encode()},
        add={"data/constants/tensor_evil": pickle.dumps(_CreatesMarker(marker))},
    )
    ep = load_program(evil)
    assert not marker.exists()
    assert ep.constants["evil"].device.type == "meta" and tuple(ep.constants["evil"].shape) == (3,)

    config["config"]["evil"] = {"path_name": "custom_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
    evil_obj = rewrite_zip(
        mlp_file, tmp_path / "evil_obj.pt2",
        {"data/constants/model_constants_config.json": json.dumps(config).encode()},
        add={"data/constants/custom_obj_0": pickle.dumps(_CreatesMarker(marker))},
    )
    with pytest.raises(LoadError, match="refuses to unpickle"):
        load_program(evil_obj)
    assert not marker.exists()


def test_enum_and_unknown_types_in_treespec_are_not_imported() -> None:
    enum_key = {"__enum__": True, "fqn": "boomfx_no_such_module:E", "name": "A"}
    spec = json.dumps([1, {"type": "builtins.dict", "context": json.dumps([enum_key]),
                           "children_spec": [{"type": None, "context": None, "children_spec": []}]}])
    replaced: list[str] = []
    loaded = torch.utils._pytree.treespec_loads(sanitize_treespec(spec, {}, replaced))
    assert loaded.context == ["boomfx_no_such_module:E.A"] and replaced
    unknown = json.dumps([1, {"type": "boomfx_no_such_module.Out", "context": "{\"weird\": 1}",
                              "children_spec": [{"type": None, "context": None, "children_spec": []}] * 2}])
    loaded = torch.utils._pytree.treespec_loads(sanitize_treespec(unknown, {}, []))
    assert loaded.type is tuple and loaded.num_leaves == 2
    assert "boomfx_no_such_module" not in sys.modules


# ------------------------------------------------------------------------------------------------
# Errors: one clear sentence each
# ------------------------------------------------------------------------------------------------


class _NonFinite(nn.Module):
    """Fills with the floats JSON has no number for, as routers do (DeepSeek-V3, PhiMoE: masked_fill -inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x > 0, float("-inf")).clamp(max=float("inf")) + x.masked_fill(x > 1, float("nan"))


def test_non_finite_float_arguments_load_as_torch_loads_them(tmp_path: Path) -> None:
    """torch's serializer writes -inf, inf and nan as the strings "-Infinity", "Infinity" and "NaN"; the
    file is valid (torch.export.load reads it) and loads to the same graph, not as a corrupt one."""
    import math

    path = export_to(tmp_path / "nonfinite.pt2", _NonFinite(), (torch.zeros(4, 8),), {"x": {0: Dim("batch")}})
    text = read_record(path, "models/model.json").decode()
    assert all(f'"{word}"' in text for word in ("-Infinity", "Infinity", "NaN"))
    ours, theirs = load_program(path), torch.export.load(path)
    assert_same_program(ours, theirs)

    def non_finite(ep) -> list[str]:
        return [repr(a) for n in ep.graph.nodes for a in n.args if isinstance(a, float) and not math.isfinite(a)]
    assert non_finite(ours) == non_finite(theirs) == ["-inf", "inf", "nan"]


@pytest.mark.parametrize("replacement, shown", [('"-Infinite"', "'-Infinite'"), ('{"a": 1}', "{'a': 1}"),
                                                 ("[1.5]", r"\[1.5\]")])
def test_a_float_field_holding_anything_else_is_refused(tmp_path: Path, replacement: str, shown: str) -> None:
    path = export_to(tmp_path / "nonfinite.pt2", _NonFinite(), (torch.zeros(4, 8),), {"x": {0: Dim("batch")}})
    data = read_record(path, "models/model.json").decode().replace('"-Infinity"', replacement, 1)
    bad = rewrite_zip(path, tmp_path / "bad.pt2", {"models/model.json": data.encode()})
    with pytest.raises(LoadError, match=f"is {shown}, not a number"):
        load_program(bad)


def _model_json(path: Path) -> dict:
    return json.loads(read_record(path, "models/model.json"))


@pytest.mark.parametrize(
    "make_bad, message",
    [
        (lambda src, d: d / "missing.pt2", "does not exist"),
        (lambda src, d: (d / "notes.pt2").write_text("just text\n") and d / "notes.pt2", "not a zip archive"),
        (lambda src, d: (d / "trunc.pt2").write_bytes(src.read_bytes()[: src.stat().st_size // 2]) and d / "trunc.pt2",
         "not a zip archive|corrupt"),
        (lambda src, d: rewrite_zip(src, d / "badjson.pt2", {"models/model.json": b"{not json"}), "not valid JSON"),
        (lambda src, d: rewrite_zip(src, d / "nomodel.pt2", {"models/model.json": None}), "no models/model.json"),
        (lambda src, d: rewrite_zip(src, d / "future.pt2", {"models/model.json": json.dumps(
            {**_model_json(src), "schema_version": {"major": 99, "minor": 0}}).encode()}), "schema version 99.0"),
        (lambda src, d: _zip_of(d / "other.pt2", {"hello.txt": b"hi"}), "not a torch.export .pt2 archive"),
    ],
    ids=["missing", "text-file", "truncated", "bad-json", "no-model-json", "schema-version", "other-zip"],
)
def test_bad_inputs_raise_load_error(mlp_file: Path, tmp_path: Path, make_bad, message: str) -> None:
    bad = make_bad(mlp_file, tmp_path)
    with pytest.raises(LoadError, match=message) as info:
        load_program(bad)
    text = str(info.value)
    assert str(bad) in text and "\n" not in text and text.endswith(".")


def _zip_of(path: Path, records: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in records.items():
            z.writestr(name, data)
    return path


# ------------------------------------------------------------------------------------------------
# Fallback
# ------------------------------------------------------------------------------------------------


def test_fast_path_failure_falls_back_to_torch_deserializer(mlp_file: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise NotImplementedError("node kind the fast path does not know")

    monkeypatch.setattr(pt2_fast, "deserialize_fast", broken)
    messages: list[str] = []
    ours = load_program(mlp_file, log=messages.append)
    assert_same_program(ours, torch.export.load(mlp_file))
    assert any("falling back" in m and "does not know" in m for m in messages)
    assert any("torch's deserializer" in m for m in messages[-1:])


def test_verbose_prints_path_to_stderr(mlp_file: Path, capsys) -> None:
    load_program(os.fspath(mlp_file), verbose=True)
    assert "fast path" in capsys.readouterr().err
