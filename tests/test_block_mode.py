"""Block mode: `boomfx kernels collect --for FILE --blocks` measures each repeated block whole on the local
device; the analysis then prices every instance of that block by the measurement ("block-measured")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import boomfx
from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.cli.main import main
from boomfx.core.devices import cpu_spec
from boomfx.kernels_db.block_runner import (
    BlockTooLargeError, TensorEntry, extract_block, make_block_inputs, run_graph_values, time_block,
)
from boomfx.kernels_db.blocks_db import BLOCK_OP, block_key, block_records, collect_blocks
from boomfx.kernels_db.store import Store
from boomfx.passes.blocks import block_pass
from boomfx.core.program import ProgramOptions

BATCH, SEQ = 2, 8


@pytest.fixture(autouse=True)
def _restore_threads():
    """``kernels collect --threads N`` sets the process's thread count; later tests must get theirs back."""
    import torch
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _collect(path: str, db: Path, train: bool) -> str:
    argv = ["kernels", "collect", "--device", "cpu", "--for", path, "--blocks", "--batch", str(BATCH),
            "--seq", str(SEQ), "--db", str(db), "--quiet"] + (["--train"] if train else [])
    assert main(argv) == 0
    return argv[-1]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_collect_blocks_then_analysis_uses_the_block_time(capsys, exported, tmp_path: Path, train: bool) -> None:
    _, path = exported("gpt")
    db = tmp_path / "cpu.sqlite"
    _collect(path, db, train)
    out = capsys.readouterr().out
    assert "measured 1," in out and "failed 0" in out          # tiny GPT: one class, h.* (2 instances)
    _collect(path, db, train)
    assert "measured 0, already present 1," in capsys.readouterr().out

    rows = block_records(Store(db), "cpu")
    assert len(rows) == 1
    (record,) = rows.values()
    assert record.key.op == BLOCK_OP and record.source == "measured:cpu" and record.median_ns > 0
    phases = record.key.data["phases"]
    assert phases == (["backward", "forward"] if train else ["forward"])

    report = boomfx.analyze(path, device="cpu", train=train, batch=BATCH, seq=SEQ, db=str(db))
    in_block = [k for k in report.kernels if k.block is not None]
    outside = [k for k in report.kernels if k.block is None]
    assert in_block and {k.source for k in in_block} == {"block-measured"}
    assert "block-measured" not in {k.source for k in outside}
    for instance in ("h.0", "h.1"):
        total = sum(k.time_ns for k in report.kernels if k.block == instance)
        assert total == pytest.approx(record.median_ns, rel=1e-9)   # each instance sums to the measurement
    assert report.blocks[0].time_ns_per_instance == pytest.approx(record.median_ns, rel=1e-9)
    # CPU: ops run one after another, so the step is the sum of kernel times, blocks included, plus the
    # cold starts and eager dispatch of the kernels outside measured blocks (kernels_db/host_overheads.py)
    assert report.time.total_ns == pytest.approx(sum(k.time_ns + (0 if k.source in ("block-measured",) else
                                                                  k.host_ns) for k in report.kernels)
                                                 + report.time.cold_start_ns + report.time.eager_dispatch_ns,
                                                 rel=1e-6)


def test_block_rows_do_not_disturb_kernel_pricing(capsys, exported, tmp_path: Path) -> None:
    """A database holding both kernel rows and block rows: kernels outside blocks keep their rows' price
    (timed inside the step by `collect --for`, kernels_db/in_step.py)."""
    _, path = exported("gpt")
    db = tmp_path / "cpu.sqlite"
    assert main(["kernels", "collect", "--device", "cpu", "--for", path, "--batch", str(BATCH), "--seq", str(SEQ),
                 "--db", str(db), "--threads", "1", "--quiet"]) == 0   # CPU-time clock: busy machines' rows pass
    _collect(path, db, train=False)
    capsys.readouterr()
    report = boomfx.analyze(path, device="cpu", batch=BATCH, seq=SEQ, db=str(db))
    assert {k.source for k in report.kernels if k.block is None} == {"measured-in-step"}
    assert {k.source for k in report.kernels if k.block is not None} == {"block-measured"}


def test_blocks_needs_for(capsys) -> None:
    assert main(["kernels", "collect", "--device", "cpu", "--blocks"]) == 2
    assert "--blocks needs --for" in capsys.readouterr().err


def test_a_block_that_does_not_fit_is_skipped_cleanly(exported, tmp_path: Path) -> None:
    _, path = exported("gpt")
    program = capture(path, options=ProgramOptions(target_kind="cpu"))
    analysis = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none"))
    bindings = resolve_bindings(program, {}, BATCH, SEQ)
    db = tmp_path / "cpu.sqlite"
    result = collect_blocks(Store(db), analysis, bindings, "cpu", progress=False, free_bytes=1)
    assert result.measured == () and [name for name, _ in result.too_large] == ["h.*"]
    assert "GiB free" in result.too_large[0][1]
    assert block_records(Store(db), "cpu") == {}
    block = extract_block(program, analysis.blocks.classes[0], analysis.evaluator(bindings), torch.device("cpu"))
    with pytest.raises(BlockTooLargeError):
        time_block(block, make_block_inputs(block, torch.device("cpu")), torch.device("cpu"), free_bytes=1)


def test_key_has_bound_shapes_and_differs_by_size(exported) -> None:
    _, path = exported("gpt")
    program = capture(path, options=ProgramOptions(target_kind="cpu"))
    analysis = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none"))
    cls = analysis.blocks.classes[0]
    small = extract_block(program, cls, analysis.evaluator(resolve_bindings(program, {}, 2, 8)), build=False)
    large = extract_block(program, cls, analysis.evaluator(resolve_bindings(program, {}, 4, 8)), build=False)
    assert block_key(small).key_hash != block_key(large).key_hash
    # the activation entering the block: [batch, seq, d] = [2, 8, 32], contiguous
    act = next(b for b in small.inputs if b.kind == "activation")
    assert act.value == TensorEntry((2, 8, 32), (256, 32, 1), 0, torch.float32)
    assert {b.kind for b in small.inputs} == {"activation", "param"}


# ---------------------------------------------------------------------------------------------------
# Equivalence: the extracted subgraph computes what those nodes compute inside the whole graph
# ---------------------------------------------------------------------------------------------------
def _whole_graph_inputs(program, ev) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    args = {}
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["val"]
        shape = [ev(s.node.expr) if isinstance(s, torch.SymInt) else s for s in val.shape]
        if val.dtype.is_floating_point:
            args[node.name] = torch.randn(shape, generator=gen, dtype=val.dtype) * 0.1
        else:
            args[node.name] = torch.randint(0, 32, shape, generator=gen, dtype=val.dtype)   # < vocab 128, d 32
    return args


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_extracted_block_computes_the_same_values_as_the_whole_graph(exported, train: bool) -> None:
    ep, _ = exported("gpt", "cpu")
    program = capture(ep, options=ProgramOptions(train, target_kind="cpu"))
    info = block_pass(program)
    bindings = resolve_bindings(program, {}, BATCH, SEQ)
    analysis = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none"))
    ev = analysis.evaluator(bindings)
    args = _whole_graph_inputs(program, ev)
    pristine = {name: t.clone() for name, t in args.items()}     # the optimizer updates params in place
    values = run_graph_values(program.gm, list(args.values()))
    for cls in info.classes:
        for instance in range(len(cls.instances)):
            block = extract_block(program, cls, ev, torch.device("cpu"), instance=instance)
            inputs = [pristine[b.node] if b.node in pristine else values[b.node] for b in block.inputs]
            with torch.no_grad():
                outs = block.gm(*inputs)
            assert len(outs) == len(block.outputs) > 0
            for name, out in zip(block.outputs, outs):
                torch.testing.assert_close(out, values[name], rtol=1e-5, atol=1e-6, msg=f"{cls.name} {name}")
            if train:   # forward and backward of the layer are one instance: the gradient flows in
                assert "gradient" in {b.kind for b in block.inputs}
