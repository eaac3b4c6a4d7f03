"""Block detection: repeated layers as classes of isomorphic subgraphs, and depth-free reuse.

Each model is built on the meta device and exported once per module (fixtures), with dynamic batch
and sequence where the model allows it.
"""
from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from models import GPT, GPTBlock, Llama

from boomfx.frontend.capture import capture, export_param_names, export_roles
from boomfx.analysis.build_report import block_reports
from boomfx.passes.blocks import (
    METHOD_MODULES, METHOD_STRUCTURE, BlockInfo, block_pass, is_value_node, representatives,
)
from boomfx.passes.costs.registry import Cost, price_call
from boomfx.passes.evaluate import Evaluator
from boomfx.passes.liveness import Category, liveness_pass
from boomfx.passes.opcall import opcall_from_node
from boomfx.core.program import Program, ProgramOptions
from boomfx.report.model import KernelReport

DYNAMIC = {0: Dim("batch"), 1: Dim("seq", min=2)}


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------
# GPT and Llama are examples/models.py's; only the mixed-layer model below is local.
class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.ln(x))))


class AlternatingGPT(nn.Module):
    """Kept local: GPT blocks alternating with a different (MLP-only) block, a structure examples/models.py's
    GPT (identical layers) does not have; block detection must then find two classes."""

    def __init__(self, n_layer: int = 4, d: int = 64, heads: int = 4, vocab: int = 128) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(MLPBlock(d) if i % 2 else GPTBlock(d, heads) for i in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def _gpt(n_layer: int = 3) -> nn.Module:
    return GPT(vocab=128, d=64, layers=n_layer, heads=4)


def _llama(n_layer: int = 4) -> nn.Module:
    return Llama(vocab=128, d=64, layers=n_layer, heads=4, kv_heads=2, hidden=96)


def _export(model: nn.Module, dynamic: bool = True) -> torch.export.ExportedProgram:
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    shapes = (DYNAMIC,) if dynamic else None
    return torch.export.export(model, (ids,), dynamic_shapes=shapes, strict=False)


def _program(ep: torch.export.ExportedProgram, train: bool = False) -> Program:
    """``capture(ep)``; if capture itself fails (at the time of writing it cannot read the unbounded
    upper range ``int_oo`` of a dynamic dim), the same Program built from its parts, so these tests
    exercise block detection rather than capture."""
    try:
        return capture(ep, options=ProgramOptions(train=train))
    except Exception:  # noqa: BLE001 - the fallback below is the same construction without symbols
        if not train:
            return Program(ep.graph_module, {}, export_roles(ep), param_names=export_param_names(ep))
        from boomfx.training import trace as training
        traced = training.build_training_program(ep)
        return Program(traced.gm, {}, dict(traced.input_roles), ProgramOptions(train=True),
                       phases=dict(traced.phases), grad_nodes=dict(traced.grad_nodes),
                       param_names=dict(traced.param_names))


def _strip_module_stacks(program: Program) -> Program:
    """A copy of ``program`` whose nodes carry no module metadata (node names and phases kept)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(program.graph, {})      # node_copy copies each node's meta dict
    graph.output(out)
    for node in graph.nodes:
        node.meta.pop("nn_module_stack", None)
    assert [n.name for n in graph.nodes] == [n.name for n in program.graph.nodes]
    gm = torch.fx.GraphModule(program.gm, graph)
    return Program(gm, program.symbols, program.input_roles, program.options, dict(program.phases))


@pytest.fixture(scope="module")
def gpt() -> Program:
    with torch.device("meta"):
        model = _gpt(3)
    return _program(_export(model))


@pytest.fixture(scope="module")
def llama() -> Program:
    with torch.device("meta"):
        model = _llama(4)
    return _program(_export(model))


@pytest.fixture(scope="module")
def hf_gpt2() -> Program:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    ep = torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes={"input_ids": DYNAMIC},
                             strict=False)
    return _program(ep)


@pytest.fixture(scope="module")
def hf_llama() -> Program:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    ep = torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes={"input_ids": DYNAMIC},
                             strict=False)
    return _program(ep)


@pytest.fixture(scope="module")
def gpt_train() -> Program:
    with torch.device("meta"):
        model = _gpt(3)
    return _program(_export(model, dynamic=False), train=True)


# ---------------------------------------------------------------------------------------------------
# Detection with module metadata
# ---------------------------------------------------------------------------------------------------
def _single_class(info: BlockInfo, name: str, count: int) -> None:
    assert [c.name for c in info.classes] == [name]
    cls = info.classes[0]
    assert len(cls.instances) == count
    assert len({len(names) for names in cls.nodes}) == 1          # same size, position by position


def test_gpt_style_has_one_class_of_n_layers(gpt: Program) -> None:
    info = block_pass(gpt)
    assert info.method == METHOD_MODULES
    _single_class(info, "h.*", 3)
    cls = info.classes[0]
    assert cls.instances == ("h.0", "h.1", "h.2")
    assert cls.module_type == "GPTBlock"
    # canonical correspondence: position i of every instance is the same op
    by_name = {n.name: n for n in gpt.graph.nodes}
    for i in range(cls.nodes_per_instance):
        assert len({by_name[names[i]].target for names in cls.nodes}) == 1


def test_llama_style_rmsnorm_rotary_gqa(llama: Program) -> None:
    info = block_pass(llama)
    _single_class(info, "layers.*", 4)
    assert info.classes[0].module_type == "LlamaBlock"


def test_transformers_gpt2(hf_gpt2: Program) -> None:
    info = block_pass(hf_gpt2)
    _single_class(info, "transformer.h.*", 3)
    assert info.classes[0].module_type == "GPT2Block"


def test_transformers_llama(hf_llama: Program) -> None:
    info = block_pass(hf_llama)
    _single_class(info, "model.layers.*", 3)
    assert info.classes[0].module_type == "LlamaDecoderLayer"


def test_every_other_layer_different_gives_two_classes() -> None:
    with torch.device("meta"):
        model = AlternatingGPT(n_layer=4)
    info = block_pass(_program(_export(model)))
    assert [(c.name, c.instances) for c in info.classes] == [
        ("h.* (GPTBlock)", ("h.0", "h.2")), ("h.* (MLPBlock)", ("h.1", "h.3"))]


def test_node_to_block_is_consistent(gpt: Program) -> None:
    info = block_pass(gpt)
    for c, cls in enumerate(info.classes):
        for k, names in enumerate(cls.nodes):
            for i, name in enumerate(names):
                ref = info.node_to_block[name]
                assert (ref.class_index, ref.instance, ref.position) == (c, k, i)
                assert info.instance_of(name) == cls.instances[k]
    assert info.block_of("embedding") is None


# ---------------------------------------------------------------------------------------------------
# Training graphs: forward, backward (and recompute) nodes of a layer are one instance
# ---------------------------------------------------------------------------------------------------
def test_training_graph_instances_hold_forward_and_backward(gpt_train: Program) -> None:
    info = block_pass(gpt_train)
    assert info.method == METHOD_MODULES
    _single_class(info, "h.*", 3)
    for names in info.classes[0].nodes:
        phases = {gpt_train.phases.get(n, "forward") for n in names}
        assert phases == {"forward", "backward"}
    # the backward sum of the residual gradients has no module; it is absorbed into its layer
    by_name = {n.name: n for n in gpt_train.graph.nodes}
    for names in info.classes[0].nodes:
        assert any(by_name[n].meta.get("nn_module_stack") is None for n in names)


# ---------------------------------------------------------------------------------------------------
# Structural path: no nn_module_stack at all
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture, count", [("gpt", 3), ("llama", 4)])
def test_structural_detection_without_metadata(request: pytest.FixtureRequest, fixture: str,
                                               count: int) -> None:
    program = request.getfixturevalue(fixture)
    with_meta = block_pass(program)
    stripped = _strip_module_stacks(program)
    info = block_pass(stripped)
    assert info.method == METHOD_STRUCTURE
    assert len(info.classes) == 1 and len(info.classes[0].instances) == count
    # the cut-point rotation puts the boundaries where the layers begin: same nodes as with metadata
    assert [set(n) for n in info.classes[0].nodes] == [set(n) for n in with_meta.classes[0].nodes]


def test_structural_detection_on_training_graph(gpt_train: Program) -> None:
    info = block_pass(_strip_module_stacks(gpt_train))
    assert info.method == METHOD_STRUCTURE
    # forward stack and backward stack are found separately (no metadata links them)
    assert sorted(len(c.instances) for c in info.classes) == [3, 3]


def test_no_repeats_no_classes() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(F.relu(self.a(x)))

    ep = torch.export.export(Two(), (torch.randn(2, 8),), strict=False)
    info = block_pass(_program(ep))
    assert info.classes == () and info.node_to_block == {}


class _TwoBranches(nn.Module):
    """A layer whose two branches are traced in either order: instances equal up to node order."""

    def __init__(self, d: int, swap: bool) -> None:
        super().__init__()
        self.a, self.b, self.swap = nn.Linear(d, d), nn.Linear(d, d), swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swap:
            v = torch.tanh(self.b(x))
            u = torch.sigmoid(self.a(x))
        else:
            u = torch.sigmoid(self.a(x))
            v = torch.tanh(self.b(x))
        return x + u * v


class _ReorderedLayers(nn.Module):
    def __init__(self, n_layer: int = 4, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, d)
        self.layers = nn.ModuleList(_TwoBranches(d, swap=i % 2 == 1) for i in range(n_layer))
        self.head = nn.Linear(d, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_instances_equal_up_to_node_order_merge_and_map_node_for_node(monkeypatch) -> None:
    import boomfx.passes.blocks as blocks
    with torch.device("meta"):
        program = _program(_export(_ReorderedLayers()))
    info = block_pass(program)
    assert [(c.name, c.instances) for c in info.classes] == [
        ("layers.*", ("layers.0", "layers.1", "layers.2", "layers.3"))]
    # the reordered instance's node i is instance 0's node i: the same op on the same projection
    cls = info.classes[0]
    by_name = {n.name: n for n in program.graph.nodes}
    ref, swapped = cls.nodes[0], cls.nodes[1]
    assert [by_name[n].target for n in ref] == [by_name[n].target for n in swapped]
    # past the size cap no match is tried: the swapped layers become a class of their own, never wrong
    monkeypatch.setattr(blocks, "MATCH_MAX_NODES", len(ref) - 1)
    capped = block_pass(program)
    assert sorted(c.instances for c in capped.classes) == [("layers.0", "layers.2"), ("layers.1", "layers.3")]
    # so is a pair whose search runs out of its work budget
    monkeypatch.setattr(blocks, "MATCH_MAX_NODES", len(ref))
    monkeypatch.setattr(blocks, "MATCH_WORK_PER_NODE_PAIR", 0)
    out_of_work = block_pass(program)
    assert sorted(c.instances for c in out_of_work.classes) == [("layers.0", "layers.2"), ("layers.1", "layers.3")]


# ---------------------------------------------------------------------------------------------------
# Depth-free reuse: corresponding nodes have equal OpCalls, so pricing once per class is exact
# ---------------------------------------------------------------------------------------------------
def _kernel_calls(program: Program) -> dict:
    calls = {}
    for node in program.graph.nodes:
        if is_value_node(node):
            call = opcall_from_node(node)
            if call is not None:
                calls[node.name] = call
    return calls


def _total(costs: list[Cost]) -> tuple:
    flops = sympy.expand(sum((c.flops for c in costs), sympy.Integer(0)))
    moved = sympy.expand(sum((c.bytes_read + c.bytes_written for c in costs), sympy.Integer(0)))
    return flops, moved


@pytest.mark.parametrize("fixture", ["gpt", "llama", "hf_gpt2", "hf_llama", "gpt_train"])
def test_representatives_have_equal_opcalls_and_prices(request: pytest.FixtureRequest, fixture: str) -> None:
    program = request.getfixturevalue(fixture)
    info = block_pass(program)
    reps = representatives(info)
    cls = info.classes[0]
    assert len(reps) == (len(cls.instances) - 1) * cls.nodes_per_instance
    calls = _kernel_calls(program)
    for node, rep in reps.items():
        assert (node in calls) == (rep in calls)
        if node in calls:
            assert calls[node] == calls[rep], (node, rep)
    # price every node (without reuse) vs price representatives once and reuse (with reuse)
    priced = {name: price_call(call).cost for name, call in calls.items()}
    without = _total(list(priced.values()))
    once: dict[str, Cost] = {}
    with_reuse = []
    for name, call in calls.items():
        key = reps.get(name, name)
        if key not in once:
            once[key] = price_call(calls[key]).cost
        with_reuse.append(once[key])
    assert _total(with_reuse) == without
    # reuse prices each layer class once: (instances - 1) of every block's calls are skipped
    skipped = sum(1 for name in calls if name in reps)
    assert len(once) == len(calls) - skipped


# ---------------------------------------------------------------------------------------------------
# The per-class report
# ---------------------------------------------------------------------------------------------------
def test_block_reports_time_and_activations(gpt_train: Program) -> None:
    info = block_pass(gpt_train)
    # a made-up kernel time per node: 1 ns per kernel of a block, 1000 ns per kernel elsewhere
    kernels = [KernelReport(node=n.name, op=str(n.target), module="", phase="", flops=0.0, bytes_moved=0,
                            time_ns=1.0 if n.name in info.node_to_block else 1000.0, host_ns=0.0,
                            start_ns=0.0, source="roofline", modelled=True)
               for n in gpt_train.graph.nodes if is_value_node(n)]
    liveness = liveness_pass(gpt_train)
    ev = Evaluator({})
    (report,) = block_reports(info, kernels, liveness, ev)
    cls = info.classes[0]
    assert report.name == "h.*" and report.instances == 3 and report.instance_names == ["h.0", "h.1", "h.2"]
    assert report.time_ns_per_instance == cls.nodes_per_instance * 1.0   # every member node is a "kernel"
    # activations: ACT storages created by instance 0's nodes, equal in every instance
    per_instance = []
    for names in cls.nodes:
        members = set(names)
        per_instance.append(sum(ev(iv.nbytes) for iv in liveness.intervals
                                if iv.category == Category.ACT and iv.node in members))
    assert len(set(per_instance)) == 1 and per_instance[0] > 0
    assert report.activation_bytes_per_instance == per_instance[0]
    # at least the saved ln_1 input [2, 16, 64] fp32 = 2*16*64*4 = 8192 bytes is an activation
    assert report.activation_bytes_per_instance >= 8192
    assert math.isfinite(report.time_ns_per_instance)


def test_signatures_are_stable_across_versions() -> None:
    """``BlockClass.signature`` finds block rows in kernel databases, so it is a digest of the key as it
    was first printed (a TensorSpec as its repr string): these are the shipped examples' classes as
    they were before the key stopped printing specs (2026-12-06); a change here orphans stored rows."""
    from pathlib import Path
    examples = Path(__file__).resolve().parents[1] / "examples"
    expected = {("gpt_tiny.pt2", False): "58f6485d906d", ("gpt_tiny.pt2", True): "1ab98ae2783d",
                ("llama_tiny.pt2", False): "9e203aa9e726", ("llama_tiny.pt2", True): "5c11b7747133"}
    for (name, train), signature in expected.items():
        program = capture(str(examples / name), options=ProgramOptions(train=train))
        assert [c.signature for c in block_pass(program).classes] == [signature]
