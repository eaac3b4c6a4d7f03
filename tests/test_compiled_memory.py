"""Compiled (``--compile``) training memory against a real ``torch.compile``d step on this CPU.

The model is a small causal LM of the shape the broad benchmark's decoders have (RMSNorm written as
transformers writes it, with dtype casts the export keeps as metadata asserts; SwiGLU; an untied
``lm_head`` with a vocabulary large enough that the logits are the largest activation) trained with
cross-entropy. Three Inductor/AOTAutograd mechanisms decide its peak, each checked on the program and
then all together against the profiler peak of the real step:

- cross-entropy's log-probabilities are never stored: the loss's gather evaluates them from per-row
  statistics, the partitioner saves the logits instead, and the backward's gradient kernel writes over
  the saved logits (a donated buffer, ``buf1 = mm; del mm  # reuse`` in Inductor's output code);
- a metadata assert reading a kernel's intermediate does not make it a stored buffer;
- a value saved for the backward anyway (the residual sum) is where recomputation starts, so the
  normalised activation is recomputed from it rather than saved.
"""
from __future__ import annotations

import json
import subprocess
import sys

import torch

from boomfx.analysis.analysis import Analysis
from boomfx.core.devices import get_device
from boomfx.core.program import ProgramOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.passes.compiled import fused_nodes
from boomfx.passes.fused_op import FusedKernel

VOCAB, DIM, HIDDEN, BATCH, SEQ = 1024, 64, 256, 4, 64


class _RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.norm1 = _RMSNorm(DIM)
        self.gate = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.up = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.down = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.norm2 = _RMSNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        x = self.norm1(h)
        h = h + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        return self.lm_head(self.norm2(h))


def _export():
    torch.manual_seed(0)
    model = _TinyLM()
    return torch.export.export(model, (torch.randint(0, VOCAB, (BATCH, SEQ)),))


def _compiled_program(ep):
    return capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="cross_entropy"))


def _shape(spec) -> tuple[int, ...]:
    return tuple(int(d) for d in spec.shape)


def real_step_memory_error(ep, tmp_path, loss: str, fresh_process: bool = False,
                           **options) -> tuple[float, int, int]:
    """(signed error, predicted, measured) of the peak above the step's start: ``boomfx.validate`` of the
    saved export against the profiler peak of the real compiled training step, one thread; in a fresh
    Python process with ``fresh_process`` (no earlier compiled step there)."""
    path = tmp_path / "program.pt2"
    torch.export.save(ep, str(path))
    kwargs = dict(train=True, compile=True, loss=loss, db="none", repeats=1, warmup=0, threads=1, **options)
    if fresh_process:
        code = ("import json, sys; from boomfx.validate import validate; "
                "r = validate(sys.argv[1], **json.loads(sys.argv[2])); print(json.dumps([r.memory_error, "
                "r.predicted_peak_above_start_bytes, r.measured_peak_above_start_bytes]))")
        out = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(kwargs)], capture_output=True,
                             text=True, check=True)
        error, predicted, measured = json.loads(out.stdout.strip().splitlines()[-1])
        return error, predicted, measured
    from boomfx.validate import validate
    r = validate(str(path), **kwargs)
    return r.memory_error, r.predicted_peak_above_start_bytes, r.measured_peak_above_start_bytes


def test_log_probabilities_are_never_stored_and_their_gradient_overwrites_the_logits():
    program = _compiled_program(_export())
    kernels = [n.target for n in fused_nodes(program)]
    logits = (BATCH * SEQ, VOCAB)
    forward_big = [k for k in kernels if k.phase == "forward" and any(_shape(s)[-1:] == (VOCAB,) for s in k.output_specs)]
    assert forward_big == []         # the loss kernel outputs the loss only; the logits are the matmul's
    loss_kernel = next(k for k in kernels if k.phase == "forward" and "nll_loss_forward" in k.ops)
    assert "_log_softmax" in loss_kernel.ops
    grad = next(k for k in kernels if k.phase == "backward" and "nll_loss_backward" in k.ops)
    assert "_log_softmax" in grad.ops and "_log_softmax_backward_data" in grad.ops   # recomputed there
    assert [_shape(s) for s in grad.output_specs] == [logits]
    assert grad.inplace == (next(i for i, s in enumerate(grad.input_specs) if _shape(s) == logits),)


def test_a_metadata_assert_does_not_store_a_kernel_intermediate():
    program = _compiled_program(_export())
    norms = [n.target for n in fused_nodes(program) if n.target.phase == "forward" and "rsqrt" in n.target.ops]
    assert norms
    for kernel in norms:     # the residual (saved) and the weighted output (the matmuls' input) at most
        full = [s for s in kernel.output_specs if _shape(s) == (BATCH, SEQ, DIM)]
        assert len(full) <= 2, [(_shape(s)) for s in kernel.output_specs]


def test_peak_equals_the_real_compiled_step(tmp_path):
    """Predicted peak above the step's start against the profiler peak of the real compiled step
    (``boomfx.validate``: same program, same loss). Memory is deterministic: within 2%."""
    error, predicted, measured = real_step_memory_error(_export(), tmp_path, "cross_entropy")
    assert abs(error) <= 0.02, (predicted, measured)
    # without the three mechanisms the log-probabilities and their gradient (2 x 1 MiB) were on top
    program = _compiled_program(_export())
    report = Analysis(program, get_device("cpu")).evaluate(resolve_bindings(program, {})).report
    assert report.memory.peak_live_bytes - report.memory.resident_bytes == predicted



class _LinearBnRelu6(torch.nn.Module):
    """MobileNet's unit (batch norm with batch statistics, ReLU6) after linears instead of convolutions,
    whose CPU kernels would add scratch memory the graph does not show."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU6(),
            torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU6(), torch.nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_batch_norm_output_is_recomputed_not_saved(tmp_path):
    """Training batch norm is one reduction kernel (its running statistics become copies), ReLU6's
    backward is pointwise, and the backward recomputes the batch norm's output from its input and the
    saved statistics instead of keeping it: against the real compiled step, within 2% (kept outputs made
    MobileNetV2 +34%, benchmarks/results/compiled_memory.md)."""
    torch.manual_seed(0)
    model = _LinearBnRelu6().train()
    ep = torch.export.export(model, (torch.randn(512, 64),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="mean"))
    unfused = [n for n in program.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.hardtanh_backward.default, torch.ops.aten._native_batch_norm_legit.default)]
    assert unfused == []                        # both inside generated kernels
    error, predicted, measured = real_step_memory_error(ep, tmp_path, "mean")
    assert abs(error) <= 0.02, (predicted, measured)


class _DepthwiseSeparable(torch.nn.Module):
    """ConvNeXt-style blocks: a patchify stem, 7x7 depthwise convolutions, 1x1 pointwise ones, GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 64, 4, stride=4)
        self.dw1 = torch.nn.Conv2d(64, 64, 7, padding=3, groups=64)
        self.pw1 = torch.nn.Conv2d(64, 128, 1)
        self.dw2 = torch.nn.Conv2d(128, 128, 7, padding=3, groups=128)
        self.pw2 = torch.nn.Conv2d(128, 64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.pw2(self.dw2(torch.nn.functional.gelu(self.pw1(self.dw1(x)))))
        return x.mean(dim=(2, 3))


def test_depthwise_backward_runs_contiguous_as_inductors_backward_hands_it(tmp_path):
    """Inductor's backward graph has no layout optimisation: a depthwise ``convolution_backward`` gets its
    input copied into (N, H, C, W) order and a contiguous gradient, so oneDNN runs it contiguous and its
    weight gradient comes out contiguous (no copy before the optimizer). Modelled as channels-last, the
    7x7 weight gradients' 257x partials made ConvNeXt +122.8% (benchmarks/results/compiled_memory.md).
    Against the real compiled step within 3%."""
    torch.manual_seed(0)
    ep = torch.export.export(_DepthwiseSeparable().train(), (torch.randn(8, 3, 64, 64),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="mean"))
    depthwise = [n for n in program.graph.nodes
                 if n.target is torch.ops.aten.convolution_backward.default and n.args[9] > 1]
    assert len(depthwise) == 2
    for node in depthwise:
        grad_out, inp = node.args[0].meta["val"], node.args[1].meta["val"]
        assert inp.permute(0, 2, 1, 3).is_contiguous() and grad_out.is_contiguous()
        assert not inp.is_contiguous(memory_format=torch.channels_last)
    error, predicted, measured = real_step_memory_error(ep, tmp_path, "mean")
    assert abs(error) <= 0.03, (predicted, measured)


class _StemPool(torch.nn.Module):
    """A ResNet-style stem: convolution, training batch norm, ReLU, 3x3 max pool, then a convolution."""

    def __init__(self, head_channels: int = 64) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 32, 7, stride=2, padding=3, bias=False)
        self.norm = torch.nn.BatchNorm2d(32)
        self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.head = torch.nn.Conv2d(32, head_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.norm(self.conv(x))))).mean(dim=(2, 3))


def test_low_memory_max_pool_saves_int8_offsets_and_recomputes_its_input():
    """Inductor's max pool stores int8 window offsets (not int64 indices), its backward reads the pooled
    input's size only, and the stem's ReLU output is recomputed in the backward from the saved
    convolution output and batch statistics (passes/low_memory_max_pool.py, partitioner), as the output
    code of a compiled step of this model shows (``getitem_3`` int8; the backward's kernel recomputes
    ``_native_batch_norm_legit_functional`` and ``relu``). With them a transformers ResNet's compiled
    step went from +15.5% to -0.0% (benchmarks/results/compiled_memory.md). This model's own peak is in
    that stem backward kernel, which Inductor runs with two internal 1 MiB buffers (the pool
    gradient's scatter and the batch norm backward's second pass) that we do not model: -8% there; so
    this test checks the program, not the peak."""
    torch.manual_seed(0)
    ep = torch.export.export(_StemPool().train(), (torch.randn(8, 3, 64, 64),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="mean"))
    pools = [n for n in program.graph.nodes if n.target is torch.ops.aten.max_pool2d_with_indices.default]
    assert len(pools) == 1 and pools[0].meta["val"][1].dtype == torch.int8
    saved = [n for n in program.graph.nodes if program.phase_of(n) == "forward" and n.op == "call_function"
             and any(program.phase_of(u) == "backward" for u in n.users)]
    saved_bytes = sum(n.meta["val"].untyped_storage().nbytes() for n in saved
                      if isinstance(n.meta.get("val"), torch.Tensor))
    # what Inductor's backward graph takes as saved inputs: the convolution output (1 MiB), the pooled
    # values (256 KiB), int8 offsets (64 KiB), the channels-last copies of the image and both weights,
    # the batch statistics (32 floats each), and of the pool's input its shape only
    conv_out, pooled, offsets = 8 * 32 * 32 * 32 * 4, 8 * 32 * 16 * 16 * 4, 8 * 32 * 16 * 16
    copies = (8 * 3 * 64 * 64 + 32 * 3 * 7 * 7 + 64 * 32 * 3 * 3) * 4
    assert conv_out + pooled + offsets + copies <= saved_bytes <= conv_out + pooled + offsets + copies + 1024, \
        saved_bytes
    backward_pools = [n for n in program.graph.nodes if n.target is torch.ops.aten.max_pool2d_with_indices_backward.default]
    assert len(backward_pools) == 1 and backward_pools[0].args[1].meta["val"].untyped_storage().nbytes() <= 4


def test_a_dense_backward_gets_its_gradient_channels_last(tmp_path):
    """Inductor's backward requires a dense ``convolution_backward``'s incoming gradient in its
    channels-last input's order, and the kernel computing it (here the mean's backward) writes it so:
    no copy inside the call. Under a wide head (32 -> 256 channels) the peak is that backward's: +39%
    with a contiguous gradient and its 2 MiB copy; against the real compiled step within 2%."""
    torch.manual_seed(0)
    ep = torch.export.export(_StemPool(head_channels=256).train(), (torch.randn(8, 3, 64, 64),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="mean"))
    head = [n for n in program.graph.nodes if n.target is torch.ops.aten.convolution_backward.default
            and n.args[2].meta["val"].shape[0] == 256]
    assert len(head) == 1
    assert head[0].args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)
    # the real step in a fresh process: after another compiled step in the same process this model's
    # real peak measured 0.9 MiB higher (5.99 MiB against 5.08 MiB alone; not explained)
    error, predicted, measured = real_step_memory_error(ep, tmp_path, "mean", fresh_process=True)
    assert abs(error) <= 0.02, (predicted, measured)


def test_a_generated_max_pool_holds_no_eager_scratch(tmp_path):
    """Eager ``max_pool2d`` runs ``max_pool2d_with_indices`` and drops its int64 indices: a database measured
    eagerly gives the pool that temporary as workspace (512 KiB in a transformers ResNet, which put its
    compiled inference +23% over the real step with a database, -0.8% without). Under --compile Inductor
    generates the pool (no library call, no indices) inside its producer's kernel (``max_pool2d`` decomposed as
    AOTAutograd does, passes/pool_decompositions.py): no pool kernel is priced, so no row's scratch counts;
    eager keeps the row's."""
    from boomfx.analysis.analysis import AnalyzeOptions
    from boomfx.kernels_db.keys import kernel_key
    from boomfx.kernels_db.measure import Measurement, Measurer
    from boomfx.kernels_db.store import Store

    ep = torch.export.export(_StemPool().eval(), (torch.randn(8, 3, 64, 64),))
    device, workspace = get_device("cpu"), 3 << 20
    db = tmp_path / "pool.sqlite"
    fingerprint = Measurer("cpu").fingerprint()
    peaks = {}
    eager_pool = None
    for compiled in (False, True):
        program = capture(ep, options=ProgramOptions(train=False, compile=compiled, target_kind="cpu"))
        bindings = resolve_bindings(program, {})
        calls = Analysis(program, device, AnalyzeOptions("cpu", db="none")).kernel_calls(bindings)
        pool = [c for c in calls if "max_pool2d" in str(c.op)]
        if compiled:     # in a generated kernel: the fused group of the stem's batch norm, ReLU and pool
            assert pool == [] and any("max_pool2d_with_indices" in c.args["desc"] for c in calls
                                      if str(c.op) == "boomfx.fused.default")
        else:
            (eager_pool,) = pool
        with Store(db) as store:
            store.put_many([Measurement(5e4, 5e4, 5e4, 5, 5e4, workspace, "measured:cpu")
                            .record(fingerprint, kernel_key(eager_pool))])
        report = Analysis(program, device, AnalyzeOptions("cpu", db=str(db))).evaluate(bindings).report
        bare = Analysis(program, device, AnalyzeOptions("cpu", db="none")).evaluate(bindings).report
        rows = [k for k in report.kernels if "max_pool2d" in k.op]
        assert [k.workspace_bytes for k in rows] == ([] if compiled else [workspace])
        peaks[compiled] = (report.memory.peak_live_bytes, bare.memory.peak_live_bytes)
    assert peaks[True][0] == peaks[True][1]           # compiled: the row's workspace never counts
    assert peaks[False][0] > peaks[False][1]          # eager: the pool's indices are a real temporary


class _NewGeluMLP(torch.nn.Module):
    """GPT-2's MLP with transformers' ``NewGELUActivation`` written out as pointwise ops: eager autograd saves
    a ``detach`` of the tanh output for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.fc = torch.nn.Linear(64, 256)
        self.proj = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.proj(h)


def test_tanh_gelu_is_recomputed_through_autograds_detach(tmp_path):
    """The min-cut partitioner recomputes the tanh in the backward from the saved MLP input: autograd's
    ``detach`` of the tanh output is no reason to save it (GPT-2, Phi and BLOOM compiled training were
    +17%, benchmarks/results/heldout_memory.md). Against the real compiled step, within 2%."""
    torch.manual_seed(0)
    ep = torch.export.export(torch.nn.Sequential(_NewGeluMLP(), _NewGeluMLP()).train(), (torch.randn(8, 128, 64),))
    program = capture(ep, options=ProgramOptions(train=True, compile=True, target_kind="cpu", loss="mean"))
    saved_tanh = [n for n in program.graph.nodes if n.op == "call_function" and getattr(n.target, "phase", None)
                  == "forward" and "tanh" in n.target.ops and any(program.phase_of(u) == "backward"
                                                                   for u in n.users)]
    assert saved_tanh == []          # no forward kernel with the tanh hands a value to the backward directly
    error, predicted, measured = real_step_memory_error(ep, tmp_path, "mean")
    assert abs(error) <= 0.02, (predicted, measured)


class _GlobalResponseNorm(torch.nn.Module):
    """ConvNeXt V2's block: depthwise convolution, LayerNorm over channels-last, linear, GELU, global
    response norm (a reduction over the image), linear, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(32, 32, 7, padding=3, groups=32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 128)
        self.gamma = torch.nn.Parameter(torch.zeros(1, 1, 1, 128))
        self.beta = torch.nn.Parameter(torch.zeros(1, 1, 1, 128))
        self.proj = torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc(self.norm(self.dw(x).permute(0, 2, 3, 1))))
        g = torch.linalg.vector_norm(h, ord=2, dim=(1, 2), keepdim=True)
        n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
        return x + self.proj(self.gamma * (h * n) + self.beta + h).permute(0, 3, 1, 2)


def test_global_response_norm_product_is_recomputed_across_the_reduction(tmp_path):
    """``h * n`` (a full-size product of the GELU output and per-image statistics) is recomputed in the
    backward, though the norm's reduction puts the GELU, the statistics and the product in different
    fusion groups of ours: AOTAutograd's partitioner knows no groups (ConvNeXt V2 compiled training was
    +20.7%). Against the real compiled step, within 2%."""
    torch.manual_seed(0)
    ep = torch.export.export(torch.nn.Sequential(_GlobalResponseNorm(), _GlobalResponseNorm()).train(),
                             (torch.randn(8, 32, 16, 16),))
    error, predicted, measured = real_step_memory_error(ep, tmp_path, "mean")
    assert abs(error) <= 0.02, (predicted, measured)


class _PreNormBlock(torch.nn.Module):
    """MPT's block: LayerNorm, attention written out (scores, causal mask, softmax, ``dropout`` absent),
    residual, LayerNorm, GELU MLP, residual."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        x = x + self.out((attn @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def _in_place_sources(program, op: str) -> list:
    """For each backward kernel containing ``op``: the ops of the kernel whose output one of its outputs is
    written over (followed through views and ``getitem``), or None where every output gets a new buffer."""
    found = []
    for node in fused_nodes(program):
        kernel = node.target
        if kernel.phase != "backward" or op not in kernel.ops:
            continue
        written = [i for i in kernel.inplace if i is not None]
        source = node.args[written[0]] if written else None
        while source is not None and not isinstance(source.target, FusedKernel):
            source = source.args[0] if source.op == "call_function" else None
        found.append(None if source is None else source.target.ops)
    return found


class _PreNormLM(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.Sequential(*[_PreNormBlock(DIM) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.blocks(self.embed(input_ids))))


def test_backward_writes_over_the_saved_softmax_and_the_residual_gradient(tmp_path):
    """Two in-place writes of Inductor's compiled backward (its output code: ``buf20 = div_1; del div_1
    # reuse`` and ``buf13 = buf3; del buf3  # reuse``): the softmax backward writes over the saved softmax
    output, which it also sums (a reduction the output depends on runs first and does not block it); the
    LayerNorm backward that adds the residual gradient writes over that gradient, an output of the previous
    LayerNorm backward kernel. Without them MPT's compiled training peak was +3.5%, this LM's (256 tokens,
    the attention scores the largest tensors) +10.8%; against the real compiled step, within 1%."""
    torch.manual_seed(0)
    ep = torch.export.export(_PreNormLM(2).train(), (torch.randint(0, VOCAB, (BATCH, 256)),))
    program = _compiled_program(ep)
    softmax = _in_place_sources(program, "_softmax_backward_data")
    assert len(softmax) == 2 and all(s is not None and "_softmax" in s for s in softmax), softmax
    norms = _in_place_sources(program, "native_layer_norm_backward")
    assert sum(s is not None and "native_layer_norm_backward" in s for s in norms) >= 3, norms
    error, predicted, measured = real_step_memory_error(ep, tmp_path, "cross_entropy")
    assert abs(error) <= 0.01, (predicted, measured)
