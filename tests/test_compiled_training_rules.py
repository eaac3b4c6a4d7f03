"""Four AOTAutograd/Inductor rules of a compiled training step, each read in Inductor's output code of a
held-out model's compiled step (benchmarks/results/compiled_memory.md) and checked here on a small
program: a view's gradient is a pointwise loop, the joint graph's repeated values are computed once,
a compiled backward frees a saved tensor after its last reader, and an embedding output is saved."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from boomfx.core.program import PHASE_BACKWARD, PHASE_FORWARD, ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.cse import eliminate_common_subexpressions
from boomfx.passes.fusion import CLASS_POINTWISE, fusion_groups, node_class
from boomfx.passes.liveness import step_liveness_pass
from boomfx.passes.partitioner import recomputable

aten = torch.ops.aten


class _FusedProjection(torch.nn.Module):
    """Falcon's attention input: one q/k/v projection sliced three ways, and a GELU MLP beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)
        self.fc = torch.nn.Linear(64, 256)
        self.out = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        q, k, v = (qkv[..., i * 64:(i + 1) * 64].unflatten(-1, (4, 16)).transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return x + a + self.out(F.gelu(self.fc(x)))


def _program(model: torch.nn.Module, x: torch.Tensor, compile: bool, **options):
    ep = torch.export.export(model.train(), (x,))
    return capture(ep, options=ProgramOptions(train=True, compile=compile, target_kind="cpu", loss="mean", **options))


def test_a_slice_gradient_is_a_pointwise_loop_fused_with_its_sum():
    """Inductor decomposes ``slice_backward`` into ``slice_scatter`` onto zeros, lowered as a pointwise loop:
    the three slices' gradients of a fused projection are summed in one kernel, none stored alone (Falcon's
    compiled backward: ``cpp_fused_..._slice_backward_...``; stored, its predicted peak was 2 MiB high)."""
    for op in (aten.slice_backward.default, aten.select_backward.default, aten.diagonal_backward.default):
        node = torch.fx.Graph().call_function(op, ())
        assert node_class(node) == CLASS_POINTWISE
    program = _program(_FusedProjection(), torch.randn(2, 32, 64), compile=False)
    groups = fusion_groups(program, backend="cpu")
    slices = [n.name for n in program.graph.nodes if n.target is aten.slice_backward.default]
    assert len(slices) == 3
    for name in slices:
        group = groups.groups[groups.group_of[name]]
        assert group.kind == "fused" and len(group.members) > 1     # with the add of the three gradients


class _TwiceComputed(torch.nn.Module):
    """The same scale computed twice from the input (as a model calling a helper twice does), each copy
    multiplying a different projection; and a dropout twice, which must stay two draws."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.a(x) * torch.sigmoid(x * 0.5)
        second = self.b(x) * torch.sigmoid(x * 0.5)
        return F.dropout(first, 0.1) + F.dropout(second, 0.1)


def _count(program, op, phase=PHASE_FORWARD) -> int:
    return sum(1 for n in program.graph.nodes if n.target is op and program.phases.get(n.name) == phase)


def test_the_joint_graph_computes_a_repeated_value_once_and_keeps_every_random_draw():
    program = _program(_TwiceComputed(), torch.randn(16, 32), compile=False)
    assert _count(program, aten.sigmoid.default) == 2 and _count(program, aten.bernoulli_.float) == 2
    merged = eliminate_common_subexpressions(program)
    assert _count(merged, aten.sigmoid.default) == 1 and _count(merged, aten.mul.Tensor) < _count(program, aten.mul.Tensor)
    assert _count(merged, aten.bernoulli_.float) == 2 and _count(merged, aten.empty_like.default) == 2   # two draws
    # the backward reads the one sigmoid where it read either copy; the gradients and optimizer are untouched
    assert set(merged.grad_nodes) == set(program.grad_nodes)
    def optimizer_nodes(p) -> int:
        return sum(1 for n in p.graph.nodes if p.phases.get(n.name) == "optimizer")
    assert optimizer_nodes(merged) == optimizer_nodes(program) > 0
    # inference graphs are not partitioned by AOTAutograd: no merge
    ep = torch.export.export(_TwiceComputed().eval(), (torch.randn(16, 32),))
    inference = capture(ep, options=ProgramOptions(target_kind="cpu"))
    assert eliminate_common_subexpressions(inference) is inference


class _GeluMLP(torch.nn.Module):
    """Falcon's MLP: its linears are ``x @ W.T`` (autograd's MmBackward then makes the weight gradient first)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Parameter(torch.randn(256, 64) * 0.1)
        self.out = torch.nn.Parameter(torch.randn(64, 256) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.fc.T) @ self.out.T


def _gelu_output_life(program) -> tuple[int, int, int]:
    """(last step of the GELU output's storage, step of the backward mm reading it: the second linear's
    weight gradient, step of the other mm of that linear's autograd node: its input gradient)."""
    info = step_liveness_pass(program)
    step = {name: i for i, name in enumerate(info.order)}
    nodes = list(program.graph.nodes)
    gelu = next(n for n in nodes if program.phases.get(n.name) == PHASE_FORWARD
                and (n.target is aten.gelu.default or "gelu" in getattr(n.target, "ops", ())))
    size = 8 * 16 * 256 * 4
    storage = next(iv for iv in info.intervals if iv.storage_id in set(info.node_storages[gelu.name])
                   and int(iv.nbytes) == size)

    def reads_gelu(n: torch.fx.Node) -> bool:
        return any(storage.storage_id in info.node_storages.get(a.name, ()) for a in n.all_input_nodes)
    mms = [n for n in nodes if program.phases.get(n.name) == PHASE_BACKWARD and n.target is aten.mm.default]
    weight_grad = next(n for n in mms if reads_gelu(n))
    partner = next(n for n in mms if n is not weight_grad and n.meta.get("seq_nr") == weight_grad.meta.get("seq_nr"))
    return storage.end_step, step[weight_grad.name], step[partner.name]


def test_a_compiled_backward_frees_a_saved_tensor_after_its_last_reader():
    """Eager autograd's MmBackward holds its saved input until both of its mm's are done; a compiled backward
    is one autograd node whose wrapper ``del``s the GELU output after the weight gradient's mm, before the
    input gradient's (Falcon's output code; held, its predicted peak was 2 MiB high)."""
    x = torch.randn(8, 16, 64)
    end, weight_grad, input_grad = _gelu_output_life(_program(_GeluMLP(), x, compile=False))
    assert weight_grad < input_grad and end == input_grad          # eager: held to its autograd node's end
    end, weight_grad, input_grad = _gelu_output_life(_program(_GeluMLP(), x, compile=True))
    assert weight_grad < input_grad and end == weight_grad         # compiled: freed after its last reader


def test_an_embedding_output_is_saved_not_recomputed():
    """``embedding`` is not on AOTAutograd's recomputation allowlist: its output is saved for the first
    norm's backward (a compiled Qwen2 step's ``buf0``), while a pointwise op of it may be recomputed."""
    embedding = torch.fx.Graph().call_function(aten.embedding.default, ())
    cat = torch.fx.Graph().call_function(aten.cat.default, ())
    mul = torch.fx.Graph().call_function(aten.mul.Tensor, ())
    assert not recomputable(embedding) and not recomputable(cat) and recomputable(mul)

    class _Embedded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(128, 32)
            self.norm = torch.nn.LayerNorm(32)
            self.head = torch.nn.Linear(32, 128)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.embed(ids)))

    ep = torch.export.export(_Embedded().train(), (torch.randint(0, 128, (4, 16)),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="mean"))
    embedding_kernels = [n for n in program.graph.nodes if program.phases.get(n.name) == PHASE_FORWARD
                         and "embedding" in getattr(n.target, "ops", ())]
    assert len(embedding_kernels) == 1
    recomputed = [n for n in program.graph.nodes if program.phases.get(n.name) == PHASE_BACKWARD
                  and "embedding" in getattr(n.target, "ops", ())]
    assert recomputed == []
