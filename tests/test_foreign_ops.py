"""Custom ops a .pt2 names but this process has not registered (issue 14: Mixtral's grouped-mm fallback).

The file is written by a subprocess that defines the op, so this process has never seen it; loading it
must give stand-ins with the schema the calls imply, priced by the bytes they move and listed as
unmodelled; with the op registered (its library imported), the real op is used."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import boomfx
from boomfx.core.errors import UnsupportedError
from boomfx.frontend.loader import load_program
from boomfx.passes.foreign_ops import foreign_name, is_foreign
from boomfx.passes.op_names import op_from_name, op_name

NAMESPACE = "boomfx_test_lib"   # registered only inside the subprocess
BATCH, D_IN, D_OUT = 4, 16, 8

_WRITER = textwrap.dedent(f"""
    import sys, torch
    from torch.export import Dim

    @torch.library.custom_op("{NAMESPACE}::scaled_proj", mutates_args=())
    def scaled_proj(x: torch.Tensor, w: torch.Tensor, alpha: float, *, clamp: bool = False) -> torch.Tensor:
        y = alpha * (x @ w)
        return y.clamp(-1, 1) if clamp else y

    @scaled_proj.register_fake
    def _(x, w, alpha, *, clamp=False):
        return x.new_empty(x.shape[0], w.shape[1])

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn({D_IN}, {D_OUT}))

        def forward(self, x):
            y = torch.ops.{NAMESPACE}.scaled_proj(x, self.w, 0.5, clamp=True)
            return torch.relu(y)

    ep = torch.export.export(M(), (torch.randn({BATCH}, {D_IN}),), dynamic_shapes={{"x": {{0: Dim("batch", max=1024)}}}})
    torch.export.save(ep, sys.argv[1])
""")


@pytest.fixture(scope="module")
def custom_op_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("foreign") / "custom.pt2"
    subprocess.run([sys.executable, "-c", _WRITER, str(path)], check=True, timeout=120)
    assert not hasattr(torch.ops, NAMESPACE) or not hasattr(getattr(torch.ops, NAMESPACE), "scaled_proj")
    return str(path)


def _stand_in(ep: torch.export.ExportedProgram) -> torch.fx.Node:
    (node,) = [n for n in ep.graph.nodes if n.op == "call_function" and is_foreign(n.target)]
    return node


def test_unregistered_custom_op_loads_as_a_stand_in_with_the_calls_schema(custom_op_file: str) -> None:
    ep = load_program(custom_op_file)
    node = _stand_in(ep)
    assert foreign_name(node.target) == str(node.target) == op_name(node.target) == f"{NAMESPACE}.scaled_proj.default"
    assert op_from_name(op_name(node.target)) is node.target     # the database codec round-trips
    schema = node.target._schema
    # x, w and alpha passed positionally, clamp by keyword (keyword-only in the schema, as in the library's)
    assert [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments] == [
        ("x", "Tensor", False), ("w", "Tensor", False), ("alpha", "float", False), ("clamp", "bool", True)]
    assert [str(r.type) for r in schema.returns] == ["Tensor"]
    assert node.args[2] == 0.5 and node.kwargs == {"clamp": True}
    assert tuple(node.meta["val"].shape[1:]) == (D_OUT,)      # the recorded output metadata


def test_stand_in_is_priced_by_bytes_moved_and_listed_unmodelled(custom_op_file: str) -> None:
    report = boomfx.analyze(custom_op_file, device="h100-sxm", dims={"batch": 32})
    name = f"{NAMESPACE}.scaled_proj.default"
    assert report.unmodelled_ops == {name: 1}
    (kernel,) = [k for k in report.kernels if k.op == name]
    # fp32: reads x [32, 16] and w [16, 8], writes [32, 8]: 4 * (32*16 + 16*8 + 32*8) = 3584 bytes; no FLOPs assumed
    assert kernel.bytes_moved == 4 * (32 * 16 + 16 * 8 + 32 * 8) == 3584
    assert kernel.flops == 0 and not kernel.modelled and kernel.time_ns > 0


def test_loading_twice_reuses_one_stand_in(custom_op_file: str) -> None:
    assert _stand_in(load_program(custom_op_file)).target is _stand_in(load_program(custom_op_file)).target


def test_retrace_of_a_stand_in_is_refused_in_one_line(custom_op_file: str) -> None:
    for options in ({"train": True}, {"amp": "bf16"}):
        with pytest.raises(UnsupportedError) as err:
            boomfx.analyze(custom_op_file, device="h100-sxm", dims={"batch": 32}, **options)
        text = str(err.value)
        assert "\n" not in text and len(text) < 400 and "instead" in text and f"{NAMESPACE}.scaled_proj" in text


def test_registered_custom_op_is_used_as_is(custom_op_file: str) -> None:
    """With the library imported (here: the op defined in this process), the file's op is the real one."""
    lib = torch.library.Library("boomfx_test_lib2", "DEF")
    lib.define("scaled_proj(Tensor x, Tensor w, float alpha, *, bool clamp=False) -> Tensor")
    lib.impl("scaled_proj", lambda x, w, alpha, clamp=False: x.new_empty(x.shape[0], w.shape[1]), "Meta")
    ep = load_program(_renamed(custom_op_file, "boomfx_test_lib2"))
    (node,) = [n for n in ep.graph.nodes if n.op == "call_function" and "scaled_proj" in str(n.target)]
    assert node.target is torch.ops.boomfx_test_lib2.scaled_proj.default and not is_foreign(node.target)


def _renamed(path: str, namespace: str) -> str:
    """A copy of the file whose graph calls ``namespace``'s op instead."""
    import zipfile
    out = Path(path).with_name(f"{namespace}.pt2")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith(".json"):
                data = data.replace(f"{NAMESPACE}.".encode(), f"{namespace}.".encode())
            dst.writestr(info, data)
    return str(out)


@pytest.mark.slow
def test_mixtral_without_transformers_imported_is_priced_as_with_it(zoo, tmp_path: Path) -> None:
    """The CLI never imports transformers: its grouped-mm fallback is a stand-in there, priced by the same
    formula (by name) as the registered op in this process, so the two reports' work is identical."""
    import json
    _, path = zoo("mixtral")
    script = textwrap.dedent(f"""
        import json, sys
        from boomfx.cli.main import main
        code = main(["analyze", {path!r}, "--device", "h100-sxm", "--dim", "batch=2", "--dim", "seq=16",
                     "--json", {str(tmp_path / "r.json")!r}])
        assert "transformers.integrations.moe" not in sys.modules
        sys.exit(code)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    alone = json.loads((tmp_path / "r.json").read_text())
    here = boomfx.analyze(path, device="h100-sxm", dims={"batch": 2, "seq": 16})
    assert alone["time"]["flops"] == here.time.flops > 0
    assert "transformers.grouped_mm_fallback.default" not in alone["unmodelled_ops"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--train"], ["--train", "--amp", "bf16"]])
def test_mixtral_trains_without_transformers_imported_as_with_it(zoo, tmp_path: Path, extra: list[str]) -> None:
    """The stand-in re-runs with transformers' shape rule and backward (passes/foreign_rules.py): the CLI's
    training step, transformers never imported, has the same kernels, work, peak and time as the step traced
    with the real op and its real backward registered in this process."""
    import json
    _, path = zoo("mixtral")
    script = textwrap.dedent(f"""
        import sys
        from boomfx.cli.main import main
        code = main(["analyze", {path!r}, "--device", "h100-sxm", "--dim", "batch=2", "--dim", "seq=16",
                     *{extra!r}, "--json", {str(tmp_path / "r.json")!r}])
        assert "transformers.integrations.moe" not in sys.modules
        sys.exit(code)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    alone = json.loads((tmp_path / "r.json").read_text())
    here = boomfx.analyze(path, device="h100-sxm", dims={"batch": 2, "seq": 16}, train=True,
                          amp="bf16" if "--amp" in extra else None)
    assert torch.ops.transformers.grouped_mm_fallback_backward.default is not None   # the real op, here
    backward = [k for k in here.kernels if "grouped_mm_fallback_backward" in k.op]
    assert len(backward) == 4 and all(k.flops > 0 for k in backward)   # 2 layers x (gate_up, down)
    assert alone["time"]["flops"] == here.time.flops > 0
    assert alone["memory"]["peak_live_bytes"] == here.memory.peak_live_bytes
    assert alone["time"]["total_ns"] == pytest.approx(here.time.total_ns, rel=1e-9)
    assert sorted(alone["unmodelled_ops"]) == sorted(here.unmodelled_ops)


def test_grouped_mm_stand_in_backward_is_transformers_backward_op() -> None:
    """Under make_fx on fake tensors, the stand-in's gradient is one call of the backward op's stand-in,
    with transformers' shapes: grad_input like input [S, K], grad_weight like weight [E, K, N]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from boomfx.passes.foreign_ops import can_rerun, define_foreign_op

    op = define_foreign_op("transformers::grouped_mm_fallback", "default",
                           "(Tensor input, Tensor weight, Tensor offs) -> Tensor")
    assert can_rerun(op)

    def step(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = op(x, w, offs)
        return (y, *torch.autograd.grad(y.sum(), (x, w)))

    with FakeTensorMode():
        x, w = torch.randn(6, 4, requires_grad=True), torch.randn(3, 4, 8, requires_grad=True)
        offs = torch.tensor([2, 4, 6], dtype=torch.int32)
        graph = make_fx(step)(x, w, offs)
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and is_foreign(n.target)]
    assert [foreign_name(n.target) for n in calls] == ["transformers.grouped_mm_fallback.default",
                                                      "transformers.grouped_mm_fallback_backward.default"]
    shapes = [tuple(v.shape) for v in calls[1].meta["val"]]
    assert tuple(calls[0].meta["val"].shape) == (6, 8) and shapes == [(6, 4), (3, 4, 8)]


def test_a_rule_needs_the_exact_schema() -> None:
    """Another version of the library (another signature) stays a plain stand-in, refused by re-traces."""
    from boomfx.passes.foreign_ops import can_rerun, define_foreign_op
    op = define_foreign_op("transformers::grouped_mm_fallback", "default",
                           "(Tensor input, Tensor weight, Tensor offs, SymInt n) -> Tensor")
    assert is_foreign(op) and not can_rerun(op)
