"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): an export keeps a whole stack as one ``aten.lstm``/``gru``/
``rnn_*`` node; boomfx re-traces it as the kernels eager PyTorch runs (``boomfx/training/recurrent.py``):
oneDNN's LSTM layer per layer and direction, ATen's per-step cell ops for the others. Truth: the real eager
run's profiler (which kernels, how many); hand formulas for the layer's FLOPs and price."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.export import Dim

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import cpu_spec
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.kernels_db.cpu_model import CpuKernelModel
from boomfx.passes.costs.registry import OpCall, price_call
from test_cpu_model import PROFILE
from test_gpu_model import spec

aten = torch.ops.aten
# oneDNN's LSTM layer exists in oneDNN builds of torch only (every x86 and aarch64 wheel): the tests tracing an
# LSTM need one; the cost rules, the GRU/RNN cell loops and the host-time rule do not
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's LSTM needs a oneDNN build")


class LstmLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.rnn = torch.nn.LSTM(32, 48, 2, batch_first=True)
        self.out = torch.nn.Linear(48, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0])


class GruTagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(16, 24, 2, batch_first=True, bidirectional=True)
        self.fc = torch.nn.Linear(48, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0])


class TanhRnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.RNN(16, 24, 1)           # sequence first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0].sum(0)


STEPS = 12


def _export(name: str) -> tuple[torch.export.ExportedProgram, tuple]:
    torch.manual_seed(0)
    batch = Dim("batch", min=2, max=64)
    if name == "lstm":
        model, x, dims = LstmLM(), torch.randint(0, 64, (4, STEPS)), {0: batch}
    elif name == "gru":
        model, x, dims = GruTagger(), torch.randn(4, STEPS, 16), {0: batch}
    else:
        model, x, dims = TanhRnn(), torch.randn(STEPS, 4, 16), {1: batch}
    return torch.export.export(model, (x,), dynamic_shapes=(dims,)), (x,)


def _kernels(program) -> Counter:
    return Counter(n.target.overloadpacket.__name__ for n in program.gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))


def _eager_kernels(fn) -> Counter:
    with torch.profiler.profile() as prof:
        fn()
    return Counter({e.key.removeprefix("aten::"): e.count for e in prof.key_averages()})


def test_the_onednn_lstm_layers_flops_by_hand():
    """Input projection + recurrent projection, four gates, + 10 FLOPs per hidden unit per step; the backward
    does the products twice (passes/costs/recurrent.py)."""
    steps, batch, width, hidden = 64, 8, 256, 256
    x, state = spec(steps, batch, width), spec(1, batch, hidden)
    args = (x, spec(4 * hidden, width), spec(4 * hidden, hidden), spec(4 * hidden), spec(4 * hidden), state, state,
            False, [], 2, hidden, 1, True, False, False, False)
    forward = OpCall.build(aten.mkldnn_rnn_layer.default, args, {}, (spec(steps, batch, hidden), state, state))
    assert price_call(forward).cost.flops == 2 * 64 * 8 * (256 + 256) * 1024 + 10 * 64 * 8 * 256 == 538_181_632
    backward = OpCall.build(aten.mkldnn_rnn_layer_backward.default,
                            (x, *args[1:7], spec(steps, batch, hidden), state, state, None, None, None, False, 2,
                             hidden, 1, True, True, False, [], False, spec(100)), {}, (x,))
    assert price_call(backward).cost.flops == 4 * 64 * 8 * 512 * 1024 + 10 * 64 * 8 * 256


def test_the_lstm_layer_is_priced_from_its_probe():
    """steps x the probe's cost per step + FLOPs at its rate, per pass; a profile without the probe: the input
    projection and the per-step recurrent GEMMs at the GEMM curve's rates, the gates at sigmoid's."""
    steps, batch, width, hidden = 20, 4, 32, 32
    x, state = spec(steps, batch, width), spec(1, batch, hidden)
    weights = (spec(4 * hidden, width), spec(4 * hidden, hidden), spec(4 * hidden), spec(4 * hidden))
    outputs = (spec(steps, batch, hidden), state, state)

    def layer(train: bool) -> OpCall:
        return OpCall.build(aten.mkldnn_rnn_layer.default, (x, *weights, state, state, False, [], 2, hidden, 1,
                                                             True, False, False, train), {}, outputs)

    flops = 2 * steps * batch * (width + hidden) * 4 * hidden + 10 * steps * batch * hidden
    probed = dataclasses.replace(PROFILE, lstm_layer={"forward": (1_000.0, 1e10), "forward_train": (2_000.0, 1e10)})
    model = CpuKernelModel(probed)
    assert model(layer(False), cpu_spec()) == pytest.approx(steps * 1_000.0 + flops / 1e10 * 1e9)
    assert model(layer(True), cpu_spec()) == pytest.approx(steps * 2_000.0 + flops / 1e10 * 1e9)
    fallback = CpuKernelModel(dataclasses.replace(PROFILE, special_elements_per_s={"sigmoid": 1e9}))
    projection, recurrent = 2 * steps * batch * width * 4 * hidden, 2 * batch * hidden * 4 * hidden
    expected = (projection / PROFILE.gemm_rate("float32", projection)
                + steps * recurrent / PROFILE.gemm_rate("float32", recurrent)) * 1e9 + 5 * steps * batch * hidden
    assert fallback(layer(False), cpu_spec()) == pytest.approx(expected)


@needs_onednn
@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_the_program_holds_the_kernels_eager_runs(train: bool):
    """LSTM: one oneDNN layer per layer (forward, and its backward in training), as the real eager step's
    profiler counts them; GRU and RNN: ATen's per-step cell ops (a GRU step gates with two sigmoids and one
    tanh per layer and direction; a tanh RNN one tanh per step)."""
    options = ProgramOptions(train, "adamw" if train else "none", target_kind="cpu", loss="mean")
    for name in ("lstm", "gru", "rnn"):
        ep, inputs = _export(name)
        program = capture(ep, options=options)
        traced = _kernels(program)
        module = ep.module()

        def step() -> None:
            if train:
                module(*inputs).float().mean().backward()
            else:
                with torch.no_grad():
                    module(*inputs)

        step()
        eager = _eager_kernels(step)
        if name == "lstm":
            assert "lstm" not in traced
            assert traced["mkldnn_rnn_layer"] == eager["mkldnn_rnn_layer"] == 2
            assert traced["mkldnn_rnn_layer_backward"] == eager["mkldnn_rnn_layer_backward"] == (2 if train else 0)
        elif name == "gru":
            assert traced["sigmoid"] == eager["sigmoid_"] == 2 * STEPS * 2 * 2
            assert traced["tanh"] == eager["tanh_"] == STEPS * 2 * 2
        else:
            assert traced["tanh"] == eager["tanh"] == STEPS


@needs_onednn
def test_a_symbolic_batch_stays_symbolic():
    """The layers' C++ kernels read the batch as an int; re-traced as above, a training step at batch 8 costs
    more than at batch 4 and nothing was fixed to the example's batch."""
    for name in ("lstm", "gru"):
        ep, _ = _export(name)
        program = capture(ep, options=ProgramOptions(True, "adamw", target_kind="cpu", loss="mean"))
        analysis = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none"))
        small, large = (analysis.evaluate(resolve_bindings(program, {}, batch, None)).report for batch in (4, 8))
        assert large.memory.peak_live_bytes > small.memory.peak_live_bytes
        assert large.time.total_ns > small.time.total_ns


def test_the_cell_loops_ops_are_marked_as_atens_own_loop():
    """A GRU's per-step cell ops (forward, and their backward in training) carry META_NATIVE_LOOP: ATen's C++
    loop issues them, not Python; the layers around the GRU do not."""
    from boomfx.core.program import META_NATIVE_LOOP
    ep, _ = _export("gru")
    for train in (False, True):
        program = capture(ep, options=ProgramOptions(train, "adamw" if train else "none", target_kind="cpu",
                                                     loss="mean"))
        nodes = [n for n in program.gm.graph.nodes if n.op == "call_function"]
        sigmoids = [n for n in nodes if n.target is aten.sigmoid.default]
        assert len(sigmoids) == 2 * STEPS * 2 * 2 and all(n.meta.get(META_NATIVE_LOOP) for n in sigmoids)
        fc = [n for n in nodes if "fc" in str(n.meta.get("nn_module_stack", {}))
              and program.phase_of(n) == "forward"]
        assert fc and not any(n.meta.get(META_NATIVE_LOOP) for n in fc)
        if train:
            backward = [n for n in nodes if n.target is aten.sigmoid_backward.default]
            assert len(backward) == len(sigmoids) and all(n.meta.get(META_NATIVE_LOOP) for n in backward)


def test_a_native_loops_kernels_pay_no_python_switch():
    """with_eager_dispatch: a kernel after another of the same C++ loop pays no op switch (Python's); the first
    of the loop, after a Python-issued kernel, does; aliasing ops inside the loop are not counted."""
    from types import SimpleNamespace

    from boomfx.analysis.host_time import host_ops_before, with_eager_dispatch
    from boomfx.core.program import META_NATIVE_LOOP
    from boomfx.simulate.timeline import ScheduledKernel

    class Costs:                 # looped prices: each pays its switch (no in-step ratio holds it)
        def holds_in_step(self, source):
            return False

        def switch_ns(self, bytes_before, ns, measured):
            return 1_000.0

        def alias_ns(self, ops):
            return 500.0 * ops

    kernels = [SimpleNamespace(node=name, source="model", bytes_moved=64, time_ns=2_000.0)
               for name in ("linear", "cell_a", "cell_b", "cell_c", "head")]
    scheduled = [ScheduledKernel(name=k.node, host_ns=0.0, device_ns=2_000.0) for k in kernels]
    _, added = with_eager_dispatch(kernels, scheduled, Costs(), [0] * 5, native_loop={"cell_a", "cell_b", "cell_c"})
    assert added == [1_000.0, 1_000.0, 0.0, 0.0, 1_000.0]

    def node(name, view=False, native=False):
        meta = {META_NATIVE_LOOP: True} if native else {}
        return SimpleNamespace(op="call_function", name=name, meta=meta,
                               target=aten.view.default if view else aten.add.Tensor)
    graph = [node("a"), node("v1", view=True), node("v2", view=True, native=True), node("b")]
    assert host_ops_before(graph, {"a", "b"}) == {"a": 0, "b": 1}
