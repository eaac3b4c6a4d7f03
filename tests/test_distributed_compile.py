"""``--parallel`` with ``--compile``: each rank's program is rewritten from the eager step and then compiled
(boomfx/distributed/ranks.py), as torchtitan compiles each block while FSDP2's hooks, the TP collectives'
waits and the pipeline's sends stay kernels of their own.

Invariants checked against the eager rank programs of the same configurations (no GPU or gloo run
compiles these; the eager programs are the ones the gloo truth checks): compiling changes no message a
rank sends (the same collectives and point-to-point transfers, in number and size), fuses none of them
and none of FSDP's copy-in/copy-out ops into a kernel, and does the same work up to what Inductor
recomputes instead of saving (<= 2%, as tests/test_first_contact.py bounds it on one device)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import sympy
import torch

from boomfx.core.program import META_ACTION, ProgramOptions, Program
from boomfx.distributed.analysis import DistributedAnalysis
from boomfx.distributed.p2p import is_p2p
from boomfx.distributed.plan import ParallelConfig
from boomfx.distributed.ranks import rank_programs
from boomfx.frontend.capture import capture
from boomfx.analysis.analysis import AnalyzeOptions
from boomfx.core.devices import get_device
from boomfx.passes.compiled import fused_nodes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGS = {
    "ddp": ("dp_replicate=2", {}),
    "fsdp": ("dp_shard=2", {}),
    "hsdp": ("dp_replicate=2,dp_shard=2", {}),
    "tp": ("tp=2", {}),
    "fsdp_tp": ("dp_shard=2,tp=2", {}),
    "tp_sp_torchtitan": ("tp=2,sp", {"vocab_parallel": True}),
    "pp": ("pp=2", {}),
    "pp_tp": ("pp=2,tp=2", {}),
    "pp_fsdp": ("pp=2,dp_shard=2", {}),
    "pp_fsdp_reshard": ("pp=2,dp_shard=2", {"reshard_after_forward": True}),
}
# ops a distributed runtime issues outside compiled regions (FSDP2's copy-in/copy-out, collectives)
_RUNTIME_OPS = ("_c10d_functional.", "boomfx_pp.", "aten._chunk_cat", "aten.split_with_sizes_copy")


@pytest.fixture(scope="module")
def programs() -> dict[bool, Program]:
    path = str(EXAMPLES / "llama_tiny.pt2")
    return {compiled: capture(path, options=ProgramOptions(train=True, compile=compiled)) for compiled in (False, True)}


def _messages(program: Program) -> Counter:
    """(op, input shapes) of every collective and pipeline transfer, with the sizes bound."""
    bind = {info.symbol: 4 if info.role == "batch" else 64 for info in program.symbols.values()}
    out: Counter = Counter()
    for node in program.graph.nodes:
        if node.op != "call_function" or not (str(node.target).startswith("_c10d_functional.") or is_p2p(node)):
            continue
        if "wait_tensor" in str(node.target):
            continue
        shapes = tuple(tuple(int(sympy.sympify(d).subs(bind)) for d in a.meta["val"].shape)
                       for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
        out[(str(node.target), shapes)] += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_rank_programs_send_what_eager_ones_send(programs: dict[bool, Program], name: str) -> None:
    text, options = CONFIGS[name]
    cfg = ParallelConfig.parse(text, **options)
    eager = rank_programs(programs[False], cfg)
    compiled = rank_programs(programs[True], cfg)
    assert [rc.ranks for rc in compiled] == [rc.ranks for rc in eager]
    for e, c in zip(eager, compiled):
        fused = fused_nodes(c.program)
        assert fused, name                                   # it is compiled
        spanning = 0
        assert _messages(c.program) == _messages(e.program) and _messages(e.program), name
        for node in fused:                                   # no collective or FSDP copy inside a kernel
            members = set(node.target.members)
            inside = [n for n in e.program.graph.nodes if n.name in members and n.op == "call_function"
                      and str(n.target).startswith(_RUNTIME_OPS)]
            assert not inside, (name, node.name, inside)
            # each micro-batch's forward or backward is its own call of the compiled regions: no kernel
            # joins two (the stages' embeddings of all micro-batches read one gathered weight)
            # (of the members the eager program holds: compiling adds recomputed and decomposed nodes)
            actions = {n.meta.get(META_ACTION) for n in e.program.graph.nodes if n.name in members}
            assert len(actions) <= 1, (name, node.name, actions)
            spanning += len(actions)
        assert spanning > len(fused) // 2, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp", "tp_sp_torchtitan", "pp_tp"])
def test_compiled_ranks_do_the_eager_work_in_fewer_kernels(programs: dict[bool, Program], name: str) -> None:
    text, options = CONFIGS[name]
    cfg = ParallelConfig.parse(text, **options)
    device = get_device("h100-sxm")
    reports = {}
    for compiled, program in programs.items():
        analysis = DistributedAnalysis(program, cfg, device, AnalyzeOptions(device.name, db="none"))
        batch, seq = program.symbol("batch").symbol, program.symbol("seq").symbol
        reports[compiled] = analysis.evaluate({batch: 4, seq: 64}, rank=0).report
    flops = {c: r.time.flops for c, r in reports.items()}
    assert flops[False] <= flops[True] <= 1.02 * flops[False], flops
    assert len(reports[True].kernels) < len(reports[False].kernels)
    assert reports[True].memory.peak_live_bytes > 0
