"""A rank's fx graph with _c10d_functional collectives scheduled on compute and communication streams
(boomfx/distributed/rank_schedule.py), on graphs traced here with make_fx on fake tensors."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from boomfx.analysis.analysis import Analysis
from boomfx.core.devices import get_device
from boomfx.core.errors import CollectiveError
from boomfx.distributed.rank_schedule import c10d_packet, schedule_rank
from boomfx.frontend.capture import capture
from boomfx.kernels_db.collective_model import CollectiveGroup
from boomfx.kernels_db.collectives import CollectivePrice, price_collective
from boomfx.kernels_db.price import PriceSource
from boomfx.simulate.streams import DEFAULT_GPU_SLOWDOWN, NO_SLOWDOWN
from boomfx.simulate.timeline import ScheduledKernel, simulate

c10d = torch.ops._c10d_functional
H100 = get_device("h100-sxm")
TP8 = {"tp": CollectiveGroup.of(8)}


def _analysis(fn, *shapes, device=H100) -> Analysis:
    with FakeTensorMode():
        gm = make_fx(fn)(*[torch.empty(s) for s in shapes])
    return Analysis(capture(gm), device)


def _tp_block(x, w):
    y = torch.mm(x, w)
    r = c10d.all_reduce.default(y, "sum", "tp")
    z = torch.relu(x)
    r = c10d.wait_tensor.default(r)
    return r + z


def _tp_block_host_heavy(x, w):
    """``_tp_block`` with two more pointwise ops the host issues while the all-reduce runs."""
    y = torch.mm(x, w)
    r = c10d.all_reduce.default(y, "sum", "tp")
    z = torch.relu(x) * 2.0 + 1.0
    r = c10d.wait_tensor.default(r)
    return r + z


def _fsdp_two_units(x, s0, s1):
    """FSDP2's pattern: each unit's weight all-gathered from a resident shard right before it is used."""
    w0 = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(s0, 8, "dp_shard"))
    h = torch.mm(x, w0.view(2048, 2048))
    w1 = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(s1, 8, "dp_shard"))
    return torch.mm(h, w1.view(2048, 2048))


class _FreePricer:
    def price(self, op, message_bytes, group, dtype=None):
        return CollectivePrice(0.0, PriceSource.MODEL, "ring", "Simple", 0.0)


def test_collective_priced_by_the_collective_model_with_its_message_bytes():
    step = schedule_rank(_analysis(_tp_block, (64, 64), (64, 64)), {}, TP8)
    (ar,) = step.collectives
    # all_reduce of the [64, 64] fp32 mm output: 64 * 64 * 4 = 16384 bytes over 8 ranks in a node
    assert ar.op == "all_reduce" and ar.group == "tp" and ar.message_bytes == 16384
    expected = price_collective("all_reduce", 16384, CollectiveGroup.of(8), H100)
    span = {s.name: s for s in step.timeline.spans}
    assert span[ar.node].end_ns - span[ar.node].start_ns == pytest.approx(expected.time_ns)
    assert span[ar.node].stream == "comm:tp"
    assert span[ar.node].start_ns >= span["mm"].end_ns               # waits for its input
    assert span["add"].start_ns >= span[ar.node].end_ns             # after the wait
    rank = step.timeline.ranks[0]
    assert rank.exposed_comm_ns + rank.hidden_comm_ns == pytest.approx(expected.time_ns)


@pytest.mark.parametrize("fn,shapes,groups", [
    (_tp_block, [(64, 64), (64, 64)], TP8),
    (_fsdp_two_units, [(2048, 2048), (2048 * 2048 // 8,), (2048 * 2048 // 8,)], {"dp_shard": CollectiveGroup.of(8)}),
])
def test_free_communication_equals_the_single_device_scheduler(fn, shapes, groups):
    analysis = _analysis(fn, *shapes)
    step = schedule_rank(analysis, {}, groups, pricer=_FreePricer(), slowdown=DEFAULT_GPU_SLOWDOWN)
    # the analysis's own kernels in program order, collectives taking no device time, one stream
    nodes = {n.name: n for n in analysis.program.graph.nodes}
    single = [ScheduledKernel(s.name, s.issue_end_ns - s.issue_start_ns,
                              0.0 if c10d_packet(nodes[s.name]) else s.end_ns - s.start_ns)
              for s in step.point.timeline.spans]
    assert step.step_ns == pytest.approx(simulate(single).total_ns)
    assert step.timeline.exposed_comm_ns == 0.0


def test_fsdp_prefetch_overlap_falls_out_of_the_dependencies():
    shard = 2048 * 2048 // 8
    analysis = _analysis(_fsdp_two_units, (2048, 2048), (shard,), (shard,))
    groups = {"dp_shard": CollectiveGroup.of(8)}
    step = schedule_rank(analysis, {}, groups, slowdown=NO_SLOWDOWN)
    span = {s.name: s for s in step.timeline.spans}
    ag0, ag1 = (c.node for c in step.collectives)
    mm0 = next(s.name for s in step.timeline.spans if s.name.startswith("mm"))
    t_ag = price_collective("all_gather", 2048 * 2048 * 4, CollectiveGroup.of(8), H100).time_ns
    # the second all-gather reads a resident shard: it waits for nothing but its issue and the group's stream
    # (the first all-gather), so it runs while the first mm does
    assert span[ag1].start_ns == pytest.approx(max(span[ag1].issue_end_ns, span[ag0].end_ns))
    assert span[ag1].start_ns < span[mm0].end_ns
    assert span[ag1].end_ns <= span[mm0].end_ns                     # the mm is long enough to hide it all
    # exposed: the first all-gather only (nothing runs before it); hidden: the second
    assert step.timeline.exposed_comm_ns == pytest.approx(t_ag)
    assert step.timeline.hidden_comm_ns == pytest.approx(t_ag)
    # with the overlap slowdown f, the mm loses t_ag (1 - 1/f) of progress: the step grows by exactly that
    slow = schedule_rank(analysis, {}, groups, slowdown=DEFAULT_GPU_SLOWDOWN, point=step.point)
    f = DEFAULT_GPU_SLOWDOWN.factor
    assert slow.step_ns - step.step_ns == pytest.approx(t_ag * (1 - 1 / f))


def _ddp_bucket(x, w, bucket):
    g = torch.mm(x, w)
    r = c10d.all_reduce_.default(bucket, "sum", "dp")
    y = torch.relu(g)
    return y, c10d.wait_tensor.default(r)


def test_in_place_collective_on_a_runtime_buffer_waits_for_earlier_compute():
    step = schedule_rank(_analysis(_ddp_bucket, (512, 512), (512, 512), (4096,)), {},
                         {"dp": CollectiveGroup.of(8)})
    span = {s.name: s for s in step.timeline.spans}
    # the bucket is a graph input the runtime filled on the compute stream: the all-reduce waits for the mm
    assert span["all_reduce_"].start_ns == pytest.approx(max(span["mm"].end_ns, span["all_reduce_"].issue_end_ns))
    assert step.collectives[0].message_bytes == 4096 * 4


def test_cpu_rank_blocks_on_wait():
    step = schedule_rank(_analysis(_tp_block, (64, 64), (64, 64), device=get_device("cpu")), {},
                         {"tp": CollectiveGroup.of(2)})
    span = {s.name: s for s in step.timeline.spans}
    wait = next(s for s in step.timeline.spans if s.name.startswith("wait"))
    assert wait.end_ns == pytest.approx(span[step.collectives[0].node].end_ns)
    assert span["add"].start_ns >= wait.end_ns


def test_cpu_rank_shares_the_hosts_cores_with_gloo():
    from boomfx.core.devices import host_cores
    from boomfx.simulate.streams import cpu_core_sharing

    analysis = _analysis(_tp_block, (64, 64), (64, 64), device=get_device("cpu"))
    # the ranks on a host: a node of the groups' cluster (2 local ranks; 2 nodes of 1 rank: one a host)
    two_local = schedule_rank(analysis, {}, {"tp": CollectiveGroup.of(2)})
    assert two_local.timeline.slowdown == cpu_core_sharing(2, host_cores())
    one_local = schedule_rank(analysis, {}, {"tp": CollectiveGroup.of(2, 1)})
    assert one_local.timeline.slowdown.factor == cpu_core_sharing(1, host_cores()).factor
    # relu runs beside the all-reduce: with both slowed by f, the overlap costs (f - 1) x the shorter one
    # more than without sharing (processor sharing conserves the cores' work)
    free = schedule_rank(analysis, {}, {"tp": CollectiveGroup.of(2)}, slowdown=NO_SLOWDOWN)
    two = schedule_rank(analysis, {}, {"tp": CollectiveGroup.of(2)}, slowdown=cpu_core_sharing(2, 2, comm_cpu_share=1))
    span = {s.name: s for s in free.timeline.spans}
    ar = span[free.collectives[0].node]
    relu = span["relu"]
    assert relu.start_ns >= ar.start_ns and relu.end_ns <= ar.end_ns     # relu fully inside the all-reduce
    assert two.step_ns == pytest.approx(free.step_ns + (relu.end_ns - relu.start_ns))


def test_unknown_group_is_one_clear_error():
    with pytest.raises(CollectiveError, match="process group 'tp' has no ranks"):
        schedule_rank(_analysis(_tp_block, (64, 64), (64, 64)), {}, {"dp": CollectiveGroup.of(8)})


def _fsdp_as_the_rank_rewrite_emits_it(x):
    """boomfx/distributed/fsdp.py's nodes: all_gather_into_tensor_out into a fresh flat buffer, a reduce-scatter
    of the gradient, HSDP's in-place all-reduce of the scattered shard over the replicas."""
    flat = torch.empty(8 * 4096)
    own = flat.narrow(0, 0, 4096)
    gathered = c10d.wait_tensor.default(c10d.all_gather_into_tensor_out.default(own, 8, "dp_shard", out=flat))
    y = torch.mm(x, gathered.view(128, 256))
    shard = c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(y.view(-1), "sum", 8, "dp_shard"))
    return c10d.wait_tensor.default(c10d.all_reduce_.default(shard, "sum", "dp_replicate"))


def test_fsdp_rewrite_pattern_message_sizes_and_order():
    groups = {"dp_shard": CollectiveGroup((0, 1, 2, 3, 4, 5, 6, 7), CollectiveGroup.of(16, 8).topology),
              "dp_replicate": CollectiveGroup((0, 8), CollectiveGroup.of(16, 8).topology)}
    step = schedule_rank(_analysis(_fsdp_as_the_rank_rewrite_emits_it, (64, 128)), {}, groups)
    ag, rs, ar = step.collectives
    # all-gather: its output, 8 x 4096 fp32 = 131072 B; reduce-scatter: its input, the [64, 256] fp32 mm output
    # = 65536 B; all-reduce: the scattered shard, 65536 / 8 = 8192 B, across two nodes
    assert [(c.op, c.group, c.message_bytes) for c in (ag, rs, ar)] == [
        ("all_gather", "dp_shard", 131072), ("reduce_scatter", "dp_shard", 65536), ("all_reduce", "dp_replicate", 8192)]
    span = {s.name: s for s in step.timeline.spans}
    mm = next(n for n in span if n.startswith("mm"))
    assert span[ag.node].start_ns == pytest.approx(span[ag.node].issue_end_ns)     # nothing to wait for
    assert span[rs.node].start_ns >= span[mm].end_ns
    assert span[ar.node].start_ns >= span[rs.node].end_ns                           # through the wait
    assert span[ar.node].stream == "comm:dp_replicate"
    expected = price_collective("all_reduce", 8192, groups["dp_replicate"], H100).time_ns
    assert span[ar.node].end_ns - span[ar.node].start_ns == pytest.approx(expected)


def test_mesh_groups_follow_torchtitans_layout():
    from boomfx.distributed.mesh_groups import mesh_coords, mesh_groups
    from boomfx.kernels_db.collective_model import ClusterTopology
    degrees = {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 4}
    topo = ClusterTopology(4, 8)
    # rank 13 = ((pp 0 * 2 + rep 1) * 2 + shard 1) * 4 + tp 1
    assert mesh_coords(degrees, 13) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    g = mesh_groups(degrees, 13, topo)
    assert g["tp"].ranks == (12, 13, 14, 15) and g["tp"].nodes == 1
    assert g["dp_shard"].ranks == (9, 13) and g["dp_replicate"].ranks == (5, 13)
    assert g["pp"].ranks == (13, 29) and g["pp"].nodes == 2             # rank 29 is on node 3
    with pytest.raises(Exception, match="the mesh has 32 ranks"):
        mesh_groups(degrees, 0, ClusterTopology(2, 8))


def test_class_steps_resolve_groups_on_the_mesh_and_feed_the_search():
    from types import SimpleNamespace

    from boomfx.distributed.metrics import mfu
    from boomfx.distributed.search import Plan
    from boomfx.distributed.step_time import class_steps, plan_evaluator
    from boomfx.kernels_db.collective_model import ClusterTopology
    analysis = _analysis(_fsdp_as_the_rank_rewrite_emits_it, (64, 128))
    # a DistributedAnalysis-shaped stand-in: HSDP 2 x 8 on 2 nodes of 8, all ranks one class
    dist = SimpleNamespace(cfg=SimpleNamespace(dp_replicate=2, dp_shard=8, tp=1, pp=1, nodes=2, world=16),
                           classes=[SimpleNamespace(ranks=tuple(range(16)))], analyses=[analysis])
    (cls,) = class_steps(dist, {})
    ag, rs, ar = cls.step.collectives
    topo = ClusterTopology(2, 8)
    assert ag.price.time_ns == pytest.approx(
        price_collective("all_gather", 131072, CollectiveGroup(tuple(range(8)), topo), H100).time_ns)
    assert ar.price.time_ns == pytest.approx(
        price_collective("all_reduce", 8192, CollectiveGroup((0, 8), topo), H100).time_ns)    # across the nodes
    builds = []
    evaluator = plan_evaluator(lambda key: builds.append(key) or dist, lambda d, plan: {},
                               flops_per_step=lambda plan: 1e12, peak_flops_per_s=989.4e12)
    plan = Plan(2, 8, 1, 1)
    result = evaluator(plan)
    assert evaluator(plan) == result and builds == [plan.program_key()]
    assert result.time_ns == pytest.approx(cls.step.step_ns)
    assert result.fits and result.mfu == pytest.approx(mfu(1e12, cls.step.step_ns, 16, 989.4e12))


def _ddp_as_the_rank_rewrite_emits_it(x, w, bucket):
    """DDP's rewrite: the bucket's in-place all-reduce and its wait right after the bucket's last gradient,
    more backward compute, then the bucket read (the copy back to the gradients before the optimizer)."""
    g = torch.mm(x, w)
    done = c10d.wait_tensor.default(c10d.all_reduce_.default(bucket, "sum", "dp"))
    for _ in range(3):
        g = torch.mm(g, w)
    return g, bucket.mul(0.5), done


def test_waits_move_to_the_first_use_so_bucket_all_reduces_overlap_the_backward():
    analysis = _analysis(_ddp_as_the_rank_rewrite_emits_it, (1024, 1024), (1024, 1024), (1 << 22,))
    groups = {"dp": CollectiveGroup.of(16, 8)}          # two nodes: the all-reduce crosses the network
    first_use = schedule_rank(analysis, {}, groups, slowdown=NO_SLOWDOWN)
    placed = schedule_rank(analysis, {}, groups, slowdown=NO_SLOWDOWN, waits="as_placed", point=first_use.point)
    (ar,) = first_use.collectives
    t_ar = price_collective("all_reduce", (1 << 22) * 4, CollectiveGroup.of(16, 8), H100).time_ns
    span = {s.name: s for s in first_use.timeline.spans}
    mms = sorted((s for s in first_use.timeline.spans if s.name.startswith("mm")), key=lambda s: s.start_ns)
    # first use: the three mms after the wait's graph position run beside the all-reduce; the mul waits for it
    assert mms[1].start_ns < span[ar.node].end_ns
    assert span["mul"].start_ns >= span[ar.node].end_ns
    assert first_use.timeline.hidden_comm_ns > 0
    # as placed: the compute stream waits at once, nothing hides
    assert placed.timeline.hidden_comm_ns == 0.0
    assert placed.timeline.exposed_comm_ns == pytest.approx(t_ar)
    assert first_use.step_ns < placed.step_ns
    with pytest.raises(CollectiveError, match="waits must be"):
        schedule_rank(analysis, {}, groups, waits="later", point=first_use.point)


def test_communication_cost_is_what_the_collectives_add_to_the_step():
    # device-bound TP block (2048^2 fp32 mm): the all-reduce after it sits on the critical path
    analysis = _analysis(_tp_block, (2048, 2048), (2048, 2048))
    big = schedule_rank(analysis, {}, TP8, slowdown=NO_SLOWDOWN)
    free = schedule_rank(analysis, {}, TP8, pricer=_FreePricer(), slowdown=NO_SLOWDOWN, point=big.point)
    assert big.communication_cost_ns() == pytest.approx(big.step_ns - free.step_ns)
    # the add waits for all of the all-reduce's exposed part: it costs the step exactly that
    assert big.communication_cost_ns() == pytest.approx(big.timeline.exposed_comm_ns) and big.step_ns > free.step_ns
    # host-bound [64, 64] block: the host issues the final add (6 launches x 6 us = 36 us; wait_tensor launches
    # nothing) after the all-reduce has ended (~28 us): exposed on the device, free for the step
    small = schedule_rank(_analysis(_tp_block_host_heavy, (64, 64), (64, 64)), {}, TP8, slowdown=NO_SLOWDOWN)
    assert small.timeline.exposed_comm_ns > 0
    assert small.communication_cost_ns() == 0.0


def test_time_report_lists_each_class_and_its_priced_collectives():
    from types import SimpleNamespace

    from boomfx.distributed.step_time import class_steps, time_report
    analysis = _analysis(_fsdp_as_the_rank_rewrite_emits_it, (64, 128))
    dist = SimpleNamespace(cfg=SimpleNamespace(dp_replicate=2, dp_shard=8, tp=1, pp=1, nodes=2, world=16),
                           classes=[SimpleNamespace(ranks=tuple(range(16)))], analyses=[analysis])
    steps = class_steps(dist, {})
    (row,) = time_report(steps)
    assert row["ranks"] == list(range(16)) and row["step_time_ns"] == steps[0].step.step_ns
    assert [(c["op"], c["group"], c["message_bytes"], c["source"]) for c in row["collectives"]] == [
        ("all_gather", "dp_shard", 131072, "model"), ("reduce_scatter", "dp_shard", 65536, "model"),
        ("all_reduce", "dp_replicate", 8192, "model")]
    assert row["exposed_comm_ns"] + row["hidden_comm_ns"] == pytest.approx(steps[0].step.timeline.ranks[0].comm_busy_ns)
