"""Multi-stream scheduler: per rank a host issue thread, a compute stream and communication streams.

What the runtime does and this simulator keeps:

- The host issues the rank's ops in program order, each costing its ``host_ns`` (as in ``timeline.py``).
  A ``host_sync`` op makes the host wait until the op is done (``.item()``; on a CPU device every compute op,
  and a ``wait_tensor`` blocks the thread until its collective is done).
- Each stream runs its ops in issue order. An op starts at ``max(issued, previous op of its stream done,
  every op of deps done)``. Collectives of one process group share one stream (ProcessGroupNCCL runs them
  on one internal stream per group), different groups run concurrently; a ``wait`` op (``wait_tensor``) is a
  zero-length op on the compute stream that depends on its collective, so every later compute op waits too
  (``work.wait()`` makes the current stream wait for the collective's event).
- Ops sharing a ``rendezvous`` key are the same collective seen by several ranks: none starts before all
  of them could.
- While a collective runs on a rank, that rank's compute runs ``slowdown.factor`` times slower (NCCL's
  kernels take SMs and memory bandwidth); the collective runs ``slowdown.comm_factor`` times slower while
  compute runs beside it (1 on a GPU: NCCL's kernels keep their SMs; on a CPU host whose cores the ranks'
  threads fill, gloo's thread and the compute thread share the cores, ``cpu_core_sharing``). On a CPU host
  with fewer cores than the ranks' compute threads every compute op also runs ``slowdown.base`` times
  slower (processor sharing: 4 one-thread ranks on 2 cores progress at half a core each).

The engine is SimPy's: a heap of ``(t_ns, priority, seq, event)`` with a monotonic ``seq`` so equal times
pop in the order they were pushed. A running compute op's remaining work is updated whenever its rate
changes and its completion event is re-pushed (older ones carry a stale version and are skipped).

Pure function: no clocks, randomness or environment; the same inputs give the same timeline.

Example::

    >>> ops = [StreamOp("mm", COMPUTE, 10.0), StreamOp("ar", "comm:tp", 4.0, deps=("mm",)),
    ...        StreamOp("relu", COMPUTE, 3.0), StreamOp("wait", COMPUTE, 0.0, deps=("ar",)),
    ...        StreamOp("add", COMPUTE, 2.0)]
    >>> t = simulate_streams(ops, slowdown=NO_SLOWDOWN)
    >>> t.total_ns, t.exposed_comm_ns, t.hidden_comm_ns
    (16.0, 1.0, 3.0)

Known limitations:
- The slowdown is one factor for every kernel; published measurements range from none (compute-bound GEMMs
  with few SMs taken) to 1.5-1.9x (bandwidth-bound kernels next to a large all-gather).
- Collectives are not slowed by each other when two groups share a link; on a GPU, not by the compute they
  overlap either.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from boomfx.core.errors import BoomfxError

COMPUTE = "compute"
COMM_PREFIX = "comm"


class StreamError(BoomfxError):
    """Ops that cannot be scheduled: an unknown or later dependency, a duplicate name."""


@dataclass(frozen=True)
class OverlapSlowdown:
    """How much slower compute runs while a collective overlaps it (``factor``), how much slower the
    collective runs while compute overlaps it (``comm_factor``), how much slower compute always runs and a
    collective beside compute runs on top of those (``base``: a CPU host with fewer cores than its ranks'
    compute threads), and where the numbers come from."""

    factor: float
    source: str
    comm_factor: float = 1.0
    base: float = 1.0


# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
# Power Implications" (arXiv:2507.03114, 2025): GPT and Llama training on 4 A100 / H100 / MI250 / MI210,
# compute overlapped with communication runs 18.9% slower on average (40% at most). The 1.5-1.9x reports are
# single bandwidth-bound kernels next to a large all-gather; a whole step mixes them with GEMMs, so the
# average is the default. NB: not measured here (no GPU); a measured factor should replace it.
DEFAULT_GPU_SLOWDOWN = OverlapSlowdown(1.189, "arXiv:2507.03114: mean compute slowdown under overlap, 4 GPUs")
NO_SLOWDOWN = OverlapSlowdown(1.0, "off")


# How much of a core a gloo collective's threads keep busy while it runs, per rank: process CPU time over
# wall time of 30 back-to-back 2-rank all-reduces on the development VM (main thread blocked in the wait):
# 0.57-0.62 at 32 KiB-1 MiB, 0.68-0.74 at 4-12 MiB (copies into and out of loopback TCP, the sums); the
# rest is waiting on the peer. Documented here, not measured per host.
GLOO_CPU_SHARE = 0.7


def cpu_core_sharing(ranks_on_host: int, cores: int, threads_per_rank: int = 1,
                     comm_cpu_share: float = GLOO_CPU_SHARE) -> OverlapSlowdown:
    """A CPU host's ranks while their collectives run: each rank has ``threads_per_rank`` compute threads and
    gloo's threads, busy ``comm_cpu_share`` of a core while a collective runs, so ``ranks x (threads +
    share)`` cores' worth of work wants the host's ``cores``. The kernels were priced with the rank's compute
    threads on cores of their own (``max(cores, ranks x threads)`` of them shared out), so while both run,
    compute and the collective each progress at that over the demand (processor sharing: a mechanism, not a
    fit; 1.7x for 2 one-thread ranks on 2 cores). torchrun starts each of several local ranks with
    ``OMP_NUM_THREADS=1``, hence the default thread count."""
    if ranks_on_host < 1 or cores < 1 or threads_per_rank < 1 or not 0.0 <= comm_cpu_share <= 1.0:
        raise StreamError(f"core sharing needs at least one rank, core and thread and a share in [0, 1], got "
                          f"{ranks_on_host}, {cores}, {threads_per_rank} and {comm_cpu_share}")
    demand = ranks_on_host * (threads_per_rank + comm_cpu_share)
    factor = max(1.0, demand / max(cores, ranks_on_host * threads_per_rank))
    # more compute threads than cores: each progresses at cores / threads of a core, collective or not
    # (the local ranks are taken to compute together, as data and tensor parallel ranks do)
    base = max(1.0, ranks_on_host * threads_per_rank / cores)
    return OverlapSlowdown(factor, f"{ranks_on_host} ranks x ({threads_per_rank} compute + {comm_cpu_share:g} gloo) "
                                   f"threads on {cores} cores", comm_factor=factor, base=base)


def is_comm_stream(stream: str) -> bool:
    return stream.startswith(COMM_PREFIX)


@dataclass(frozen=True)
class StreamOp:
    """One op of one rank: where it runs, how long it takes alone, and what it waits for.

    ``deps`` are names of earlier ops (any stream, same rank); ``rendezvous`` ties one collective across ranks.
    """

    name: str
    stream: str
    device_ns: float
    host_ns: float = 0.0
    deps: tuple[str, ...] = ()
    host_sync: bool = False
    rank: int = 0
    rendezvous: Optional[str] = None


@dataclass(frozen=True)
class StreamSpan:
    name: str
    rank: int
    stream: str
    issue_start_ns: float
    issue_end_ns: float
    start_ns: float
    end_ns: float


@dataclass(frozen=True)
class RankTime:
    """One rank's step: total, busy compute, collective time exposed (no compute running) and hidden.

    Exposed is counted on the device, as a profile shows it: in a host-bound step the compute stream idles
    waiting for the host anyway, and an exposed collective there may cost the step nothing.
    """

    rank: int
    total_ns: float
    compute_busy_ns: float
    comm_busy_ns: float
    exposed_comm_ns: float
    hidden_comm_ns: float


@dataclass(frozen=True)
class StreamTimeline:
    spans: tuple[StreamSpan, ...]
    ranks: tuple[RankTime, ...]
    slowdown: OverlapSlowdown

    @property
    def total_ns(self) -> float:
        return max((r.total_ns for r in self.ranks), default=0.0)

    @property
    def exposed_comm_ns(self) -> float:
        """The worst rank's exposed communication (the one that sets the step)."""
        return max((r.exposed_comm_ns for r in self.ranks), default=0.0)

    @property
    def hidden_comm_ns(self) -> float:
        return max((r.hidden_comm_ns for r in self.ranks), default=0.0)

    def rank(self, rank: int) -> RankTime:
        return next(r for r in self.ranks if r.rank == rank)


# event kinds, in the order equal-time events are handled
_FINISH, _ISSUED = 0, 1


class _Op:
    __slots__ = ("spec", "index", "issue_start", "issue_end", "start", "end", "remaining", "rate", "since",
                 "version", "waiting", "issued")

    def __init__(self, spec: StreamOp, index: int) -> None:
        self.spec = spec
        self.index = index
        self.issue_start = self.issue_end = self.start = self.end = None
        self.remaining = float(spec.device_ns)
        self.rate = 1.0
        self.since = 0.0
        self.version = 0
        self.waiting = False      # a rendezvous op launched on its rank, its partners not there yet
        self.issued = False       # its issue event has been handled (the host may block on it)


class _Engine:
    def __init__(self, ops: Sequence[StreamOp], slowdown: OverlapSlowdown, synchronous: bool) -> None:
        if slowdown.factor < 1.0 or slowdown.comm_factor < 1.0 or slowdown.base < 1.0:
            raise StreamError(f"a slowdown below 1 ({slowdown.factor}, {slowdown.comm_factor}, {slowdown.base}) "
                              "would speed work up")
        self.slowdown = slowdown
        self.synchronous = synchronous
        self.ops = [_Op(spec, i) for i, spec in enumerate(ops)]
        self.by_name: dict[tuple[int, str], _Op] = {}
        self.per_rank: dict[int, list[_Op]] = {}
        for op in self.ops:
            key = (op.spec.rank, op.spec.name)
            if key in self.by_name:
                raise StreamError(f"rank {key[0]} has two ops named '{key[1]}'")
            for dep in op.spec.deps:
                if (op.spec.rank, dep) not in self.by_name:
                    raise StreamError(f"'{op.spec.name}' depends on '{dep}', which is not an earlier op of rank "
                                      f"{op.spec.rank}")
            self.by_name[key] = op
            self.per_rank.setdefault(op.spec.rank, []).append(op)
        self.groups: dict[str, list[_Op]] = {}
        for op in self.ops:
            if op.spec.rendezvous is not None:
                self.groups.setdefault(op.spec.rendezvous, []).append(op)
        self.queues: dict[tuple[int, str], list[_Op]] = {}
        for op in self.ops:
            self.queues.setdefault((op.spec.rank, op.spec.stream), []).append(op)
        self.heads = {key: 0 for key in self.queues}
        self.queue_order = sorted(self.queues)           # (rank, stream): the order ties are broken in
        self.host_next = {rank: 0 for rank in self.per_rank}
        self.host_blocked: dict[int, Optional[_Op]] = {rank: None for rank in self.per_rank}
        self.host_t = {rank: 0.0 for rank in self.per_rank}
        self.running: dict[int, list[_Op]] = {rank: [] for rank in self.per_rank}
        self.heap: list[tuple[float, int, int, int, int]] = []   # (t_ns, kind, seq, op index, version)
        self.seq = 0
        self.now = 0.0

    # -- the event heap (SimPy's contract: time, priority, insertion order) ---------------------------
    def push(self, t: float, kind: int, op: _Op) -> None:
        heapq.heappush(self.heap, (t, kind, self.seq, op.index, op.version))
        self.seq += 1

    def run(self) -> None:
        for rank in sorted(self.per_rank):
            self.issue_next(rank)
        self.start_ready()
        while self.heap:
            t, kind, _, index, version = heapq.heappop(self.heap)
            op = self.ops[index]
            self.now = t
            if kind == _FINISH:
                if version != op.version or op.end is not None:
                    continue
                self.advance(op.spec.rank, t)
                self.finish(op, t)
            else:
                self.issued(op, t)
            if not self.heap or self.heap[0][0] > t:
                self.start_ready()
        undone = [op.spec.name for op in self.ops if op.end is None]
        if undone:
            raise StreamError(f"ops never ran (a rendezvous or a dependency that cannot be met): {undone[:5]}")

    # -- host thread ---------------------------------------------------------------------------------
    def issue_next(self, rank: int) -> None:
        ops = self.per_rank[rank]
        i = self.host_next[rank]
        if i >= len(ops) or self.host_blocked[rank] is not None:
            return
        op = ops[i]
        self.host_next[rank] = i + 1
        op.issue_start = self.host_t[rank]
        host_ns = 0.0 if self.synchronous and not is_comm_stream(op.spec.stream) else op.spec.host_ns
        op.issue_end = op.issue_start + host_ns
        self.host_t[rank] = op.issue_end
        self.push(op.issue_end, _ISSUED, op)

    def issued(self, op: _Op, t: float) -> None:
        rank = op.spec.rank
        op.issued = True
        if self._blocks_host(op):
            self.host_blocked[rank] = op
        else:
            self.issue_next(rank)

    def _blocks_host(self, op: _Op) -> bool:
        if op.spec.host_sync:
            return True
        return self.synchronous and not is_comm_stream(op.spec.stream)

    # -- streams -------------------------------------------------------------------------------------
    def ready_at(self, op: _Op) -> bool:
        """Whether ``op`` could start now on its own rank (issued, stream head, dependencies done)."""
        if not op.issued:
            return False
        key = (op.spec.rank, op.spec.stream)
        head = self.heads[key]
        if self.queues[key][head] is not op:
            return False
        if head > 0 and self.queues[key][head - 1].end is None:   # the stream is still running its previous op
            return False
        for dep in op.spec.deps:
            if self.by_name[(op.spec.rank, dep)].end is None:
                return False
        return True

    def start_ready(self) -> None:
        """Start every op that can start now, until nothing changes (zero-length ops finish at once)."""
        changed = True
        while changed:
            changed = False
            for key in self.queue_order:
                queue = self.queues[key]
                head = self.heads[key]
                if head >= len(queue):
                    continue
                op = queue[head]
                if op.start is not None or not self.ready_at(op):
                    continue
                self.start(op)
                changed = True

    def release(self, group: list[_Op]) -> None:
        """Every rank has launched the collective: the transfer starts now on all of them."""
        for op in group:
            self.advance(op.spec.rank, self.now)
            op.waiting = False
            op.since = self.now
        for rank in sorted({op.spec.rank for op in group}):
            self.rerate(rank, force=[op for op in group if op.spec.rank == rank])

    def start(self, op: _Op) -> None:
        rank = op.spec.rank
        self.advance(rank, self.now)
        op.start = self.now
        op.since = self.now
        key = (rank, op.spec.stream)
        self.heads[key] += 1
        group = self.groups.get(op.spec.rendezvous) if op.spec.rendezvous is not None else None
        if group is not None:
            # NCCL's kernel launches on this rank and spins until its peers arrive: it holds the stream (and
            # slows compute) from now, its transfer starts when the last rank launches
            op.waiting = True
            self.running[rank].append(op)
            self.rerate(rank)
            if all(p.start is not None for p in group):
                self.release(group)
            return
        if op.remaining <= 0.0:
            self.finish(op, self.now)
            return
        self.running[rank].append(op)
        self.rerate(rank)

    def finish(self, op: _Op, t: float) -> None:
        rank = op.spec.rank
        op.end = t
        op.remaining = 0.0
        if op in self.running[rank]:
            self.running[rank].remove(op)
            self.rerate(rank)
        if self.host_blocked[rank] is op:
            self.host_blocked[rank] = None
            self.host_t[rank] = max(self.host_t[rank], t)
            self.issue_next(rank)

    # -- rates: compute slows down while a collective runs on the same rank (and the collective while
    # compute runs, where they share cores) -------------------------------------------------------------
    def advance(self, rank: int, t: float) -> None:
        for op in self.running[rank]:
            if not op.waiting:
                op.remaining -= (t - op.since) * op.rate
            op.since = t

    def rerate(self, rank: int, force: Sequence[_Op] = ()) -> None:
        """New rates on ``rank`` and new completion events for ops whose rate changed (or in ``force``)."""
        # NCCL's kernel spins on its peers (holding SMs); gloo's thread sleeps on them (synchronous: a CPU)
        comm_busy = any(is_comm_stream(o.spec.stream) and not (o.waiting and self.synchronous)
                        for o in self.running[rank])
        compute_busy = any(not is_comm_stream(o.spec.stream) for o in self.running[rank])
        for op in self.running[rank]:
            if op.waiting:
                continue
            if is_comm_stream(op.spec.stream):
                rate = 1.0 / (self.slowdown.base * self.slowdown.comm_factor) if compute_busy else 1.0
            else:
                rate = 1.0 / (self.slowdown.base * (self.slowdown.factor if comm_busy else 1.0))
            if rate != op.rate or op.version == 0 or op in force:
                op.rate = rate
                op.version += 1
                self.push(self.now + max(op.remaining, 0.0) / rate, _FINISH, op)


def _union_ns(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _overlap_ns(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            total += max(0.0, min(hi, b[k][1]) - max(lo, b[k][0]))
            k += 1
    return total


def _rank_time(rank: int, spans: list[StreamSpan], host_end_ns: float) -> RankTime:
    compute = _union_ns([(s.start_ns, s.end_ns) for s in spans if not is_comm_stream(s.stream)])
    comm = _union_ns([(s.start_ns, s.end_ns) for s in spans if is_comm_stream(s.stream)])
    comm_busy = sum(hi - lo for lo, hi in comm)
    hidden = _overlap_ns(comm, compute)
    total = max([host_end_ns] + [s.end_ns for s in spans])
    return RankTime(rank, total, sum(hi - lo for lo, hi in compute), comm_busy, comm_busy - hidden, hidden)


def simulate_streams(ops: Sequence[StreamOp], slowdown: OverlapSlowdown = NO_SLOWDOWN,
                     synchronous: bool = False) -> StreamTimeline:
    """Schedule ``ops`` (each rank's in program order) and return every span and each rank's step.

    ``synchronous=True`` (CPU devices): compute ops run on the host thread (no issue cost, the host waits for
    each), collectives still run on their own streams (gloo's threads) until a ``host_sync`` wait.
    """
    engine = _Engine(ops, slowdown, synchronous)
    engine.run()
    spans = [StreamSpan(op.spec.name, op.spec.rank, op.spec.stream, op.issue_start, op.issue_end, op.start, op.end)
             for op in engine.ops]
    ranks = tuple(_rank_time(rank, [s for s in spans if s.rank == rank], engine.host_t[rank])
                  for rank in sorted(engine.per_rank))
    return StreamTimeline(tuple(spans), ranks, slowdown)
