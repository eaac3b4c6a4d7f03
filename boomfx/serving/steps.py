"""Price the steps a serving engine runs: prefill chunks, decode batches and the mixed steps of
continuous batching, from the model's own graph and the same pricer every other kernel uses.

A step schedules ``N`` tokens: the decode tokens of ``B`` running sequences plus chunks of prompts.
Its time is the sum of five parts (``docs/design.md`` "Where a kernel gets its price" for each price):

1. **token-wise**: every node of the export that is neither attention-side nor logits
   (``boomfx/serving/model.py``), priced by ``Analysis.evaluate`` at ``batch=1, seq=N`` (the engine
   flattens batch x sequence into ``N`` tokens);
2. **attention**, per layer: one ``scaled_dot_product_attention`` call per shape of prefill chunk (the
   chunks of one shape batched), its ``c`` new queries against the ``t`` tokens of context so far
   (causal when the chunk is the whole context; an explicit ``[c, t]`` mask otherwise; a sliding
   layer's as its window leaves the step, ``windowed``), and one call for the decode batch: ``B`` single
   queries against their cached K/V (``B x ceil(mean context)`` tokens: the bytes of a paged kernel's
   read are linear in the total context). K/V are passed unexpanded (``enable_gqa``): a memory-bound
   read of the cache; under ``concat`` a model that broadcasts K/V heads (``AttentionSite.broadcast_kv``)
   is called as it calls SDPA, on the math path eager PyTorch runs for it, and an attention written out
   (``AttentionSite.eager``) as transformers runs it: K and V copied to the query heads, then the math path;
3. **KV-cache writes**, per layer: ``paged`` (vLLM ``reshape_and_cache``): ``index_copy_`` of the
   ``N`` new K and V rows into the cache; ``concat`` (``transformers``' ``DynamicCache.update``):
   ``torch.cat`` of each decoding sequence's whole cache with its new token, a copy that grows with
   the context (a fresh prefill stores its K/V without a copy);
4. **logits**: the LM head and its tail at ``batch=1, seq=S`` for the ``S`` sampled tokens;
5. **sampler**: greedy ``argmax`` over the ``[S, vocab]`` float32 logits.

An export that carries its KV cache (``ServingModel.carries_cache``) priced under the ``concat`` rule
(the framework it was exported from runs it as is) prices a decode-only step from the graph itself:
bound at batch=B, seq=1, past=context-1, its SDPA reads the cached context and its concatenations
copy the cache (``StepPricer.graph_decode_parts``). Under the engine's rules (``paged``) its
attention and concatenations are replaced like a plain export's.

Host time: on a CPU every op runs on the host (the sum of device + issue times, cold starts
included); on a GPU a decode-only batch of at most the largest captured size replays one CUDA graph
(padded to the next captured size, one replay's host time); other steps run piecewise (one replay per
layer plus the eager attention calls), the step taking the longer of host issue and device time.

Known limitations:
- NB: the engine's own per-step host work (scheduler, input preparation, detokenisation) is a
  ``HostOverhead`` given by the caller; zero unless measured (no vLLM values are known here).
- Tensor parallelism: the rank's own program (``boomfx/serving/tensor_parallel.py``) is priced, its
  collectives as a sixth part, ``tp_communication``, by the collective model.
- NB: the decode call prices all sequences at their mean context; a paged kernel's split-KV
  imbalance between short and long sequences is not modelled.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import sympy
import torch

from boomfx.analysis.analysis import Analysis
from boomfx.passes.compiled import CUDAGRAPH_REPLAY_HOST_NS
from boomfx.kernels_db.pricing import set_step_footprint
from boomfx.passes.costs.registry import Cost, OpCall, price_call
from boomfx.passes.specs import TensorSpec, contiguous_strides
from boomfx.serving.engine import EngineConfig, EngineRules
from boomfx.serving.model import ServingModel

aten = torch.ops.aten

KV_WRITE_PAGED = "paged"
KV_WRITE_CONCAT = "concat"
SAMPLER_DTYPE = torch.float32      # vLLM's sampler upcasts logits to float32


@dataclass(frozen=True)
class PartTime:
    """Device and host time of one part of a step (ns); on a CPU the device time includes the host's."""

    device_ns: float = 0.0
    host_ns: float = 0.0
    sources: tuple[str, ...] = ()

    def __add__(self, other: "PartTime") -> "PartTime":
        return PartTime(self.device_ns + other.device_ns, self.host_ns + other.host_ns,
                        tuple(dict.fromkeys(self.sources + other.sources)))

    def scale(self, k: float) -> "PartTime":
        return PartTime(self.device_ns * k, self.host_ns * k, self.sources)


@dataclass(frozen=True)
class HostOverhead:
    """Host time of one step outside the priced kernels: the serving framework's own Python (each
    module's ``forward``, cache bookkeeping, mask and position logic), ``fixed_ns + per_module_call_ns x``
    the module calls of a forward (``ServingModel.module_calls``). Zero by default (not modelled);
    ``source`` says where measured values came from (benchmarks/serving_cpu.py measures transformers'
    on this host with calibration models that are not among the benchmark's)."""

    fixed_ns: float = 0.0
    per_module_call_ns: float = 0.0
    source: str = "not modelled"

    def step_ns(self, module_calls: int) -> float:
        return self.fixed_ns + self.per_module_call_ns * module_calls


@dataclass(frozen=True)
class Step:
    """One scheduled step: decode contexts (tokens cached per decoding sequence, the new one included)
    and prefill chunks ``(chunk_tokens, context_tokens_after_the_chunk)``; ``sampled`` sequences sample."""

    decode_contexts: tuple[int, ...] = ()
    prefills: tuple[tuple[int, int], ...] = ()
    sampled: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return len(self.decode_contexts) + sum(c for c, _ in self.prefills)

    @property
    def num_sampled(self) -> int:
        if self.sampled is not None:
            return self.sampled
        return len(self.decode_contexts) + sum(1 for c, t in self.prefills if c == t)


@dataclass
class StepTime:
    """A priced step: its total, each part, and whether it replayed a CUDA graph."""

    total_ns: float
    parts: dict[str, PartTime] = field(default_factory=dict)
    cuda_graph: bool = False
    padded_tokens: int = 0


def _spec(shape: Sequence[int], dtype: torch.dtype) -> TensorSpec:
    shp = tuple(sympy.Integer(int(s)) for s in shape)
    return TensorSpec(shp, contiguous_strides(shp), dtype)


class StepPricer:
    """Prices steps of one model on one device under one engine's rules (see the module docstring)."""

    def __init__(self, analysis: Analysis, model: ServingModel, engine: EngineRules, config: EngineConfig,
                 kv_dtype: torch.dtype, kv_heads_per_rank: int, kv_write: Optional[str] = None,
                 bucket_tokens: int = 1, interpolate: bool = False, host_overhead: HostOverhead = HostOverhead(),
                 collectives: Optional[Any] = None, windows: Sequence[Optional[int]] = ()) -> None:
        """``windows``: each layer's sliding window (None: full attention; default: as the masks show)."""
        self.analysis = analysis
        self.model = model
        self.engine = engine
        self.config = config
        self.kv_dtype = kv_dtype
        self.kv_heads = kv_heads_per_rank
        self.kv_write = kv_write or engine.kv_write
        self.host_overhead = host_overhead
        # tensor parallelism (boomfx/serving/tensor_parallel.py: CollectiveTimes): the rank's collectives,
        # priced by the collective model as their own part instead of by the bytes they touch
        self.collectives = collectives
        self._comm_cache: dict[tuple[int, int], PartTime] = {}
        self.site = model.uniform_site()
        self.windows = tuple(windows) if windows else tuple(site.sliding_window for site in model.sites)
        self.cpu = analysis.device.kind == "cpu"
        self.graphs = (not self.cpu) and not config.enforce_eager
        self.capture_sizes = engine.cudagraph_sizes(config.max_num_seqs, config.max_num_batched_tokens) \
            if self.graphs else ()
        self._token_cache: dict[int, PartTime] = {}
        self._logits_cache: dict[int, PartTime] = {}
        self._call_cache: dict[Any, PartTime] = {}
        self._layer_cache: dict[Any, PartTime] = {}
        self._step_cache: dict[Any, StepTime] = {}
        # the workload simulation rounds contexts up to whole blocks and interpolates the token-wise
        # part between priced sizes, so a 10,000-request run prices a few hundred distinct calls
        self.bucket = max(1, bucket_tokens)
        self.interpolate = interpolate
        self.vocab = self._vocab()
        # an export that carries its cache, run the way it was exported (the concat rule: transformers'
        # DynamicCache): a decode step is the graph itself, its attention reading the cached context
        self.decode_from_graph = model.carries_cache and self.kv_write == KV_WRITE_CONCAT

    # -- parts priced from the graph --------------------------------------------------------------
    def _graph_part(self, n_tokens: int, logits: bool) -> PartTime:
        """Sum of the token-wise (or logits) nodes' times with the graph bound at batch=1, seq=n."""
        point = self.analysis.evaluate(self.model.bindings(1, max(1, n_tokens)))
        skip = self.model.attention_side
        chosen = self.model.logits_nodes
        device = host = 0.0
        sources: dict[str, None] = {}
        comm = self.collectives or ()
        for k, span in zip(point.report.kernels, point.timeline.spans):
            if k.node in skip or ((k.node in chosen) != logits) or k.node in comm:
                continue
            device += span.end_ns - span.start_ns
            host += k.host_ns
            sources[k.source] = None
        return PartTime(device, host, tuple(sources))

    def graph_decode_parts(self, batch: int, context: int) -> dict[str, PartTime]:
        """A decode step of ``batch`` sequences of ``context`` tokens each (the new one included), as a
        cache export runs it: the whole graph at batch=B, seq=1, past=context-1, split into its
        attention (SDPA, GQA expansion, mask), its cache concatenations, the LM head and the rest. The
        copies the export makes rebuilding its cache object (``ServingModel.cache_rewrap_nodes``) are
        left out: the framework keeps its cache between steps."""
        from boomfx.core.errors import OptionError
        past = self.model.past
        assert past is not None
        if context - 1 < past.min_value or (past.max_value is not None and context - 1 > past.max_value):
            raise OptionError(f"a decode step at context {context} needs {context - 1} cached tokens, outside the "
                              f"export's cache range {past.describe()}")
        key = ("graph-decode", batch, context)
        hit = self._layer_cache.get(key)
        if hit is not None:
            return dict(hit)   # type: ignore[call-overload]
        point = self.analysis.evaluate(self.model.bindings(batch, 1, context - 1))
        writes, logits, side = self.model.cache_write_nodes, self.model.logits_nodes, self.model.attention_side
        acc: dict[str, list] = {name: [0.0, 0.0, {}] for name in ("token_wise", "attention", "kv_cache_write",
                                                                   "logits")}
        for k, span in zip(point.report.kernels, point.timeline.spans):
            if k.node in self.model.cache_rewrap_nodes:
                continue
            part = ("kv_cache_write" if k.node in writes else "logits" if k.node in logits
                    else "attention" if k.node in side else "token_wise")
            acc[part][0] += span.end_ns - span.start_ns
            acc[part][1] += k.host_ns
            acc[part][2][k.source] = None
        parts = {name: PartTime(d, h, tuple(src)) for name, (d, h, src) in acc.items()}
        self._layer_cache[key] = parts   # type: ignore[assignment]
        return dict(parts)

    def token_part(self, n_tokens: int) -> PartTime:
        if self.interpolate and n_tokens not in self._token_cache:
            return self._interpolated_token_part(n_tokens)
        hit = self._token_cache.get(n_tokens)
        if hit is None:
            hit = self._token_cache[n_tokens] = self._graph_part(n_tokens, logits=False)
        return hit

    def token_grid(self) -> tuple[int, ...]:
        """Sizes the token-wise part is priced at when interpolating: powers of two, the captured
        sizes and the token budget."""
        top = self.config.max_num_batched_tokens
        grid = {1, top} | {2 ** i for i in range(top.bit_length()) if 2 ** i <= top} | set(self.capture_sizes)
        return tuple(sorted(g for g in grid if g <= top))

    def _interpolated_token_part(self, n_tokens: int) -> PartTime:
        grid = self.token_grid()
        i = bisect.bisect_left(grid, n_tokens)
        if i < len(grid) and grid[i] == n_tokens:
            return self.token_part_exact(n_tokens)
        if i == 0 or i >= len(grid):
            return self.token_part_exact(n_tokens)
        lo, hi = grid[i - 1], grid[i]
        a, b = self.token_part_exact(lo), self.token_part_exact(hi)
        w = (n_tokens - lo) / (hi - lo)
        return PartTime(a.device_ns + w * (b.device_ns - a.device_ns), a.host_ns + w * (b.host_ns - a.host_ns),
                        tuple(dict.fromkeys(a.sources + b.sources)))

    def token_part_exact(self, n_tokens: int) -> PartTime:
        hit = self._token_cache.get(n_tokens)
        if hit is None:
            hit = self._token_cache[n_tokens] = self._graph_part(n_tokens, logits=False)
        return hit

    def logits_part(self, n_sampled: int) -> PartTime:
        """The LM head and its tail for ``n_sampled`` tokens: each logits node priced at batch=1, seq=n."""
        if n_sampled <= 0 or not self.model.logits_nodes:
            return PartTime()
        hit = self._logits_cache.get(n_sampled)
        if hit is None:
            ev = self.analysis.evaluator(self.model.bindings(1, n_sampled))
            total = PartTime()
            for name in self.model.logits_nodes:
                if name not in self.analysis.costs.by_node or (self.collectives is not None and name in self.collectives):
                    continue
                price = self.analysis.price_node(name, ev)
                device = price.time_ns
                if self.cpu and not getattr(price, "host_in_time", False):
                    device += price.host_ns
                total = total + PartTime(device, price.host_ns, (str(getattr(price.source, "value", price.source)),))
            hit = self._logits_cache[n_sampled] = total
        return hit

    def communication_part(self, n_tokens: int, n_sampled: int) -> PartTime:
        """The rank's TP collectives: the token-wise ones at ``n_tokens``, the logits' at ``n_sampled``."""
        if self.collectives is None:
            return PartTime()
        key = (n_tokens, n_sampled)
        hit = self._comm_cache.get(key)
        if hit is None:
            token_ev = self.analysis.evaluator(self.model.bindings(1, max(1, n_tokens)))
            sampled_ev = self.analysis.evaluator(self.model.bindings(1, max(1, n_sampled)))
            hit = PartTime()
            for name in self.collectives.nodes:
                in_logits = name in self.model.logits_nodes
                if in_logits and n_sampled <= 0:
                    continue
                time_ns, source = self.collectives.time_ns(name, sampled_ev if in_logits else token_ev)
                hit = hit + PartTime(time_ns, 0.0, (source,))
            self._comm_cache[key] = hit
        return hit

    # -- parts priced as calls -------------------------------------------------------------------
    def price(self, call: OpCall) -> PartTime:
        """One call through the analysis' pricer (database > interpolation > model > roofline)."""
        key = (str(call.op), tuple((k, repr(v)) for k, v in call.args.items()), repr(call.outputs))
        hit = self._call_cache.get(key)
        if hit is None:
            c = price_call(call).cost
            cost = Cost(c.flops, c.bytes_read, c.bytes_written)
            # a CPU host model prices at the cache level of a step's footprint: a serving step streams
            # every weight, so its calls find their operands at least that far back (kernels_db/cpu_model.py)
            set_step_footprint(self.analysis.pricer, self.model.weights_bytes)
            p = self.analysis.pricer.price(call, cost)
            device = p.time_ns
            if self.cpu and not getattr(p, "host_in_time", False):
                device += p.host_ns
            source = str(getattr(p.source, "value", p.source))
            hit = self._call_cache[key] = PartTime(device, p.host_ns, (source,))
        return hit

    def _sdpa(self, batch: int, q_len: int, kv_len: int, causal: bool, mask: bool, kv_heads: Optional[int] = None,
              backend: Optional[str] = None) -> OpCall:
        s = self.site
        kv_heads = kv_heads or self.kv_heads
        q = _spec((batch, s.q_heads, q_len, s.head_dim), s.dtype)
        k = _spec((batch, kv_heads, kv_len, s.head_dim), self.kv_dtype)
        v = _spec((batch, kv_heads, kv_len, s.v_head_dim), self.kv_dtype)
        attn_mask = _spec((1, 1, q_len, kv_len), torch.bool) if mask else None
        out = _spec((batch, s.q_heads, q_len, s.v_head_dim), s.dtype)
        fused = "flash" if self.cpu else ("flash" if s.dtype in (torch.float16, torch.bfloat16) else "efficient")
        # the engine reads the cache unexpanded (enable_gqa); transformers (``concat``) calls SDPA as the
        # model's graph does: a model that broadcasts K/V (site.broadcast_kv) runs eager's math path
        as_model = self.kv_write == KV_WRITE_CONCAT and s.broadcast_kv
        return OpCall.build(aten.scaled_dot_product_attention.default, (q, k, v),
                            {"attn_mask": attn_mask, "is_causal": causal,
                             "enable_gqa": kv_heads != s.q_heads and not as_model},
                            (out,), {"sdpa_backend": backend or ("math" if as_model else fused)})

    def _written_out(self, batch: int, q_len: int, kv_len: int, causal: bool, mask: bool) -> list[OpCall]:
        """An attention written out (``site.eager``) as transformers' ``eager_attention_forward`` runs it:
        ``repeat_kv``'s copies of K and V to the query heads (a contiguous copy each), then matmul,
        softmax and matmul, which are SDPA's math path over the copies, and the site's other passes over
        the scores (``score_passes``: soft-capping, sinks, the scale; one elementwise pass each)."""
        s = self.site
        heads = s.q_heads
        calls = []
        if self.kv_heads != heads:
            for dim in (s.head_dim, s.v_head_dim):
                copied = _spec((batch, heads, kv_len, dim), self.kv_dtype)
                calls.append(OpCall.build(aten.clone.default, (copied,), {}, (copied,)))
        scores = _spec((batch, heads, q_len, kv_len), s.dtype)
        calls += [OpCall.build(aten.mul.Tensor, (scores, 1.0), {}, (scores,))] * s.score_passes
        return calls + [self._sdpa(batch, q_len, kv_len, causal, mask, kv_heads=heads, backend="math")]

    def attention_calls(self, step: Step) -> list[OpCall]:
        """The attention calls of one layer of ``step``."""
        attend = self._written_out if self.kv_write == KV_WRITE_CONCAT and self.site.eager else (
            lambda *a: [self._sdpa(*a)])
        calls = []
        # chunks of one shape in one call (vLLM's variable-length kernel takes them together; a sliding
        # layer's band blocks, ``windowed``, are such chunks)
        for (chunk, context), count in Counter(step.prefills).items():
            whole = chunk == context
            calls += attend(count, chunk, context, whole, not whole)
        if step.decode_contexts:
            b = len(step.decode_contexts)
            mean_ctx = math.ceil(sum(step.decode_contexts) / b)
            calls += attend(b, 1, mean_ctx, False, False)
        return calls

    def kv_write_calls(self, step: Step) -> list[OpCall]:
        """The K and V cache writes of one layer of ``step``."""
        s, h = self.site, self.kv_heads
        calls = []
        if self.kv_write == KV_WRITE_PAGED:
            n = step.num_tokens
            for dim in (s.head_dim, s.v_head_dim):
                cache = _spec((n, h, dim), self.kv_dtype)
                calls.append(OpCall.build(aten.index_copy_.default, (cache, 0, _spec((n,), torch.int64),
                                                                     _spec((n, h, dim), self.kv_dtype)), {}, (cache,)))
            return calls
        if step.decode_contexts:
            b = len(step.decode_contexts)
            ctx = math.ceil(sum(step.decode_contexts) / b)
            for dim in (s.head_dim, s.v_head_dim):
                past, new = _spec((b, h, ctx - 1, dim), self.kv_dtype), _spec((b, h, 1, dim), self.kv_dtype)
                calls.append(OpCall.build(aten.cat.default, ([past, new], -2), {}, (_spec((b, h, ctx, dim),
                                                                                         self.kv_dtype),)))
        for chunk, context in step.prefills:
            if chunk != context:   # a later chunk appends to what earlier chunks cached
                for dim in (s.head_dim, s.v_head_dim):
                    past, new = _spec((1, h, context - chunk, dim), self.kv_dtype), _spec((1, h, chunk, dim),
                                                                                          self.kv_dtype)
                    calls.append(OpCall.build(aten.cat.default, ([past, new], -2), {},
                                              (_spec((1, h, context, dim), self.kv_dtype),)))
        return calls

    def sampler_call(self, n_sampled: int) -> Optional[OpCall]:
        if n_sampled <= 0 or not self.vocab:
            return None
        logits = _spec((n_sampled, self.vocab), SAMPLER_DTYPE)
        return OpCall.build(aten.argmax.default, (logits, -1), {}, (_spec((n_sampled,), torch.int64),))

    def _vocab(self) -> int:
        for node in self.model.program.graph.nodes:
            if node.name in self.model.logits_nodes and node.op == "call_function":
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    try:
                        return int(val.shape[-1])
                    except TypeError:
                        return 0
        return 0

    @property
    def banded_windows(self) -> bool:
        """Whether a sliding layer's long prefill chunk is priced as its band (``windowed``): the engine's
        paged kernels skip the key blocks outside it; transformers' rule keeps the chunk whole."""
        return self.kv_write == KV_WRITE_PAGED

    def calls(self, step: Step) -> list[OpCall]:
        """Every call priced outside the graph for ``step`` (one layer's attention and writes, and a sliding
        layer's; what a kernel database for serving must measure)."""
        out: list[OpCall] = []
        for window in dict.fromkeys(self.windows):   # a sliding layer's calls on the step its window leaves
            out += (self.attention_calls(windowed(step, window, self.banded_windows))
                    + self.kv_write_calls(windowed(step, window)))
        sampler = self.sampler_call(step.num_sampled)
        return out + ([sampler] if sampler is not None else [])

    def kernel_calls(self, step: Step) -> list[OpCall]:
        """Every bound call ``step`` prices: the token-wise nodes at its token count, the logits nodes at
        its sampled count, and the calls of ``calls`` (the serving form of ``Analysis.kernel_calls``, for
        collecting a kernel database)."""
        from boomfx.passes.opcall import bind_call
        out: list[OpCall] = []
        if self.decode_from_graph and step.decode_contexts and not step.prefills:   # the graph itself
            b = len(step.decode_contexts)
            bound = self.analysis.kernel_calls(self.model.bindings(b, 1, math.ceil(sum(step.decode_contexts) / b) - 1))
            sampler = self.sampler_call(step.num_sampled)
            return list(bound) + ([sampler] if sampler is not None else [])
        for n, names in ((self.graph_batch(step) or step.num_tokens, None), (step.num_sampled, self.model.logits_nodes)):
            if n <= 0:
                continue
            ev = self.analysis.evaluator(self.model.bindings(1, n))
            for name, nc in self.analysis.costs.by_node.items():
                if name in self.model.attention_side:
                    continue
                if (names is None) == (name in self.model.logits_nodes):
                    continue
                out.append(bind_call(nc.call, ev))
        return out + self.calls(step)

    # -- the step ------------------------------------------------------------------------------------
    def graph_batch(self, step: Step) -> Optional[int]:
        """The captured size a decode-only step replays (None: it runs piecewise / eagerly)."""
        if not self.capture_sizes or step.prefills or not step.decode_contexts:
            return None
        i = bisect.bisect_left(self.capture_sizes, len(step.decode_contexts))
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def _rounded(self, tokens: int) -> int:
        return -(-tokens // self.bucket) * self.bucket

    def _cached(self, key: Any, step: Step, kind: str) -> PartTime:
        hit = self._layer_cache.get(key)
        if hit is None:
            calls = self.attention_calls(step) if kind == "attention" else self.kv_write_calls(step)
            hit = self._layer_cache[key] = sum((self.price(c) for c in calls), PartTime())
        return hit

    def _layer_part(self, kind: str, step: Step) -> PartTime:
        """One layer's attention or KV-write calls: the decode batch and each prefill chunk priced and
        cached on their own (sizes rounded up to the bucket), so mixed steps reuse their pieces."""
        if kind == "write" and self.kv_write == KV_WRITE_PAGED:   # one write of every scheduled token's row
            n = self._rounded(step.num_tokens)
            return self._cached((kind, "rows", n), Step((), ((n, n),)), kind)
        total = PartTime()
        b = len(step.decode_contexts)
        if b:
            mean_ctx = self._rounded(math.ceil(sum(step.decode_contexts) / b))
            total = total + self._cached((kind, "decode", b, mean_ctx), Step((mean_ctx,) * b), kind)
        shapes: Counter = Counter()
        for chunk, context in step.prefills:
            c = self._rounded(chunk)
            shapes[(c, c if chunk == context else max(c, self._rounded(context)))] += 1
        for (c, t), count in shapes.items():
            total = total + self._cached((kind, "prefill", c, t, count), Step((), ((c, t),) * count), kind)
        return total

    def _layers_part(self, kind: str, step: Step) -> PartTime:
        """Every layer's attention or KV writes: a sliding layer's on the step as its window leaves it
        (``windowed``), the full layers' on the whole contexts."""
        total = PartTime()
        banded = kind == "attention" and self.banded_windows
        for window, count in sorted(Counter(self.windows).items(), key=lambda wc: wc[0] or 0):
            total = total + self._layer_part(kind, windowed(step, window, banded)).scale(count)
        return total

    def step_time(self, step: Step) -> StepTime:
        """The time of ``step`` (see the module docstring for the parts and the host model)."""
        if self.bucket > 1:   # the simulation: one price per bucketed step shape
            b = len(step.decode_contexts)
            key = (b, self._rounded(math.ceil(sum(step.decode_contexts) / b)) if b else 0, step.prefills, step.sampled)
            hit = self._step_cache.get(key)
            if hit is None:
                hit = self._step_cache[key] = self._step_time(step)
            return hit
        return self._step_time(step)

    def _step_time(self, step: Step) -> StepTime:
        if self.decode_from_graph and step.decode_contexts and not step.prefills:
            return self._graph_decode_time(step)
        padded = self.graph_batch(step)
        n = padded or step.num_tokens
        layers = self.model.num_layers
        parts = {
            "token_wise": self.token_part(n),
            "attention": self._layers_part("attention", step),
            "kv_cache_write": self._layers_part("write", step),
            "logits": self.logits_part(step.num_sampled if padded is None else padded),
        }
        parts["sampler"] = self.sampler_part(step.num_sampled)
        if self.collectives is not None:
            parts["tp_communication"] = self.communication_part(n, step.num_sampled if padded is None else padded)
        device = sum(p.device_ns for p in parts.values())
        overhead = self.host_overhead.step_ns(self.model.module_calls)   # the framework's host work, before it launches anything
        parts["host_overhead"] = PartTime(overhead, overhead, (self.host_overhead.source,))
        if self.cpu:
            return StepTime(device + overhead, parts, False, n)
        if padded is not None:
            return StepTime(overhead + device + CUDAGRAPH_REPLAY_HOST_NS, parts, True, n)
        if self.graphs:   # piecewise: one replay per layer's token-wise pieces, attention eager
            host = (layers + 1) * CUDAGRAPH_REPLAY_HOST_NS + parts["attention"].host_ns + parts["kv_cache_write"].host_ns
        else:
            host = sum(p.host_ns for name, p in parts.items() if name != "host_overhead")
        return StepTime(overhead + max(device, host), parts, False, n)

    def _graph_decode_time(self, step: Step) -> StepTime:
        """A decode-only step of a cache export priced from its own graph (all sequences at their mean
        context); eager, as the framework that runs such an export does."""
        b = len(step.decode_contexts)
        parts = self.graph_decode_parts(b, math.ceil(sum(step.decode_contexts) / b))
        parts["sampler"] = self.sampler_part(step.num_sampled)
        device = sum(p.device_ns for p in parts.values())
        overhead = self.host_overhead.step_ns(self.model.module_calls)
        parts["host_overhead"] = PartTime(overhead, overhead, (self.host_overhead.source,))
        if self.cpu:
            return StepTime(device + overhead, parts, False, b)
        host = sum(p.host_ns for name, p in parts.items() if name != "host_overhead")
        return StepTime(overhead + max(device, host), parts, False, b)

    def sampler_part(self, n_sampled: int) -> PartTime:
        key = ("sampler", n_sampled)
        hit = self._layer_cache.get(key)
        if hit is None:
            call = self.sampler_call(n_sampled)
            hit = self._layer_cache[key] = self.price(call) if call is not None else PartTime()
        return hit


def windowed(step: Step, window: Optional[int], banded: bool = False) -> Step:
    """``step`` as a layer sliding over ``window`` tokens runs it: a decode query reads at most the window's
    keys (vLLM's kernels skip the blocks before it; transformers' ``DynamicSlidingWindowLayer`` keeps
    ``window - 1`` past tokens, so its concatenation copies the window too), and a prefill chunk after
    the first reads at most the ``chunk + window - 1`` keys its band spans.

    ``banded`` (the engine's kernels, which skip the key blocks outside the band): a chunk longer than
    the window is cut into query blocks of ``window`` tokens, each over the ``2 window - 1`` keys its band
    spans (the first block of a fresh prompt over its own ``window``, causal). Without it (transformers:
    its eager and SDPA attention compute every score of the chunk and mask them) the chunk stays whole."""
    if window is None:
        return step
    prefills: list[tuple[int, int]] = []
    for c, t in step.prefills:
        if not banded or c <= window:
            prefills.append((c, t if t == c else min(t, c + window - 1)))
            continue
        done = 0
        if c == t:                   # a fresh prompt: its first block sees only itself
            prefills.append((window, window))
            done = window
        while done < c:
            size = min(window, c - done)
            prefills.append((size, size + window - 1))
            done += size
    return dataclasses.replace(step, decode_contexts=tuple(min(c, window) for c in step.decode_contexts),
                               prefills=tuple(prefills), sampled=step.num_sampled)


# -- the engine's profiling run ------------------------------------------------------------------------

def profile_activation_bytes(analysis: Analysis, model: ServingModel, num_tokens: int, num_sampled: int) -> int:
    """Peak bytes above the weights of the engine's profiling forward of ``num_tokens`` tokens.

    The liveness intervals of the graph at ``batch=1, seq=num_tokens``, less the storages only the
    export makes (its attention mask, GQA-expanded K/V and a written-out attention's scores: attention-side
    nodes other than the attention's output), with
    the logits nodes' storages sized for the ``num_sampled`` tokens the engine computes logits for."""
    outputs = {s.node for s in model.sites}   # the attention outputs (SDPA's, a written-out one's value matmul)
    dropped = {name for name in model.attention_side if name not in outputs}
    dropped |= model.cache_input_names     # a cache export's past K/V: the KV cache itself, not the profile run's
    body = analysis.evaluator(model.bindings(1, max(1, num_tokens)))
    head = analysis.evaluator(model.bindings(1, max(1, num_sampled)))
    info = analysis.liveness
    diff = [0] * (len(info.order) + 1)
    for iv in info.intervals:
        if iv.resident or iv.node in dropped:
            continue
        size = (head if iv.node in model.logits_nodes else body)(iv.nbytes)
        diff[iv.start_step] += size
        diff[iv.end_step + 1] -= size
    live = peak = 0
    for d in diff[:-1]:
        live += d
        peak = max(peak, live)
    return int(peak)
