"""What a serving engine needs to know about an exported decoder, read off its graph.

A plain inference export (``model(input_ids)``, dynamic batch and sequence) attends every token to
every earlier token of the same sequence. A serving engine runs the same weights differently: all
scheduled tokens of all sequences are flattened into one batch for the token-wise ops, attention
reads each sequence's cached K/V instead, and logits are computed only for the tokens it samples.
This module splits the graph's nodes into those three roles:

1. **attention sites**: every ``scaled_dot_product_attention`` (one per attention layer), or every
   attention written out as ``matmul -> softmax -> matmul`` (``eager_attention.py``: Gemma-2, GPT-OSS,
   hand-written models), with its query heads, KV heads, head sizes and dtype. KV heads are read *before* any GQA expansion
   (``repeat_kv``'s ``unsqueeze -> expand -> reshape``), which the engine's kernels never run;
2. **attention-side nodes** (replaced by the engine's attention): the SDPA nodes (or the written-out
   attention's matmuls and the score ops between them), the GQA expansion
   chains feeding their key/value, and the nodes that only build the attention mask (ancestors of
   the mask that no query/key/value depends on: a ``[B, 1, S, S]`` causal mask is quadratic in the
   export's sequence, and a paged kernel builds none);
3. **logits nodes**: the last matmul before the graph's output (the LM head) and what follows it,
   computed per sampled token, not per scheduled token;
4. everything else is **token-wise**: priced at ``batch=1 x seq=N`` for ``N`` scheduled tokens.

Known limitations:
- NB: in a written-out attention, a bias added to the scores (ALiBi's) is taken as its mask (vLLM's
  kernels take ALiBi slopes as an argument: priced as a masked attention); Bloom's ``baddbmm`` form and
  relative-position attention (a second matmul into the scores) are not recognised, and such models
  are refused, as is a graph that mixes SDPA calls with written-out attention.

Exports that already carry a KV cache (past keys/values as inputs, ``boomfx/serving/cache_inputs.py``):
the KV-cache shape of each layer is read from its cache input, the past length becomes the
``past`` symbol, and the concatenations that append the new K/V are attention-side (the engine
writes its paged cache instead).

Sliding windows are read from each layer's mask (``boomfx/serving/sliding_window.py``) when
``serving_model(..., probe_windows=True)``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx

from boomfx.core.errors import BoomfxError
from boomfx.core.program import ROLE_BUFFER, ROLE_CONSTANT, ROLE_PARAM, Program, SymbolInfo
from boomfx.serving.eager_attention import eager_attentions

aten = torch.ops.aten

SDPA_OPS = frozenset({aten.scaled_dot_product_attention})
# ops a GQA/MQA expansion of K or V is built from (repeat_kv: slice/unsqueeze -> expand -> reshape)
_EXPANSION_OPS = frozenset({aten.expand, aten.repeat_interleave, aten.repeat})
_CHAIN_OPS = frozenset({aten.expand, aten.repeat_interleave, aten.repeat, aten.unsqueeze, aten.reshape, aten.view,
                        aten._unsafe_view, aten.clone, aten.contiguous, aten.slice, aten.alias, aten.index})
_INSERT_DIM_OPS = frozenset({aten.unsqueeze, aten.slice, aten.index, aten.alias})
_LOGITS_MATMULS = frozenset({aten.linear, aten.mm, aten.addmm, aten.matmul, aten.bmm})
_LOGITS_TAIL_OPS = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.to, aten._to_copy, aten.contiguous,
                              aten.clone, aten.slice, aten.alias, aten.squeeze, aten.unsqueeze,
                              aten._assert_tensor_metadata,
                              aten.div, aten.tanh, aten.mul})   # final logit soft-capping (Gemma-2)
# a tensor-parallel head's logits gathered to every rank (boomfx/serving/tensor_parallel.py): all-gather,
# wait, then its shards cut apart and concatenated on the vocabulary
_c10d = torch.ops._c10d_functional
_LOGITS_GATHER_OPS = frozenset({_c10d.all_gather_into_tensor, _c10d.wait_tensor, aten.chunk, aten.cat})
_MAX_LOGITS_HOPS = 12


class ServingModelError(BoomfxError):
    """The export is not a decoder the serving model can read."""


@dataclass(frozen=True)
class AttentionSite:
    """One attention layer: its SDPA node and the shapes the KV cache is made of."""

    node: str
    module: str
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    causal: bool
    sliding_window: Optional[int] = None       # keys a query sees when the layer slides (None: full)
    cache_inputs: tuple[str, ...] = ()         # past K and V graph inputs of an export carrying a cache
    # the model hands SDPA fewer K/V heads than query heads, unexpanded and without ``enable_gqa``
    # (Falcon's multi-query attention): broadcasting, which eager PyTorch's fused kernels refuse, so it
    # runs the math path (K/V expanded by copies, then bmm + softmax + bmm)
    broadcast_kv: bool = False
    # the attention is written out as ops (``eager_attention.py``: ``node`` is its value matmul); under
    # transformers' rules it runs them: SDPA's math path and ``score_passes`` more kernels over the scores
    eager: bool = False
    score_passes: int = 0


@dataclass(frozen=True)
class ServingModel:
    """The roles of an export's nodes, and the model facts a serving engine sizes its cache by."""

    program: Program
    sites: tuple[AttentionSite, ...]
    attention_side: frozenset[str]   # replaced by the engine's attention (SDPA, GQA expansion, mask)
    logits_nodes: frozenset[str]     # the LM head and its tail: per sampled token
    weights_bytes: int
    batch: SymbolInfo
    seq: SymbolInfo
    module_calls: int = 0            # distinct nn.Module invocations the export traced (nn_module_stack)
    past: Optional[SymbolInfo] = None   # the cached length of an export that carries a KV cache
    cache_write_nodes: frozenset[str] = frozenset()   # its own cache concatenations (attention-side too)
    cache_rewrap_nodes: frozenset[str] = frozenset()  # of which: copies made rebuilding the cache object

    @property
    def carries_cache(self) -> bool:
        return self.past is not None

    @property
    def cache_input_names(self) -> frozenset[str]:
        return frozenset(name for s in self.sites for name in s.cache_inputs)

    def bindings(self, batch: int, seq: int, past: Optional[int] = None) -> dict:
        """The graph's symbols for ``batch`` sequences of ``seq`` new tokens. A cache export's past
        length is ``past``, or its smallest exported value (the engine's own attention replaces the
        graph's; token-wise nodes do not depend on it)."""
        out = {self.batch.symbol: batch, self.seq.symbol: seq}
        if self.past is not None:
            out[self.past.symbol] = self.past.min_value if past is None else past
        return out

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.sites) if s.sliding_window is not None)

    @property
    def num_layers(self) -> int:
        return len(self.sites)

    @property
    def dtype(self) -> torch.dtype:
        return self.sites[0].dtype

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def max_seq_len(self) -> Optional[int]:
        """The longest context the export can price: its sequence range, or for a cache export the
        past range plus the one token a decode step adds."""
        if self.past is not None:
            return None if self.past.max_value is None else self.past.max_value + 1
        return self.seq.max_value

    def uniform_site(self) -> AttentionSite:
        """The shape every layer shares (the engine's uniform KV-cache spec); mixed shapes are refused."""
        first = self.sites[0]
        for s in self.sites[1:]:
            if (s.kv_heads, s.head_dim, s.v_head_dim, s.q_heads, s.dtype) != (
                    first.kv_heads, first.head_dim, first.v_head_dim, first.q_heads, first.dtype):
                raise ServingModelError(f"attention layers differ in shape ({first.node} vs {s.node}); "
                                        "only uniform KV-cache specs are modelled")
        return first


def _int(value: object, what: str, node: torch.fx.Node) -> int:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ServingModelError(f"{node.name}: the {what} is symbolic ({value}); a serving model needs it fixed") from None


def _packet(node: torch.fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


def _arg(node: torch.fx.Node, index: int, name: str) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _expansion_chain(start: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node]:
    """(the nodes of a GQA expansion feeding an SDPA input, the unexpanded tensor). No expansion: ([], start).

    Walks back from the SDPA input through reshapes/copies to an ``expand`` (or ``repeat``), then
    through the ``[:, :, None]`` views in front of it: repeat_kv's ``unsqueeze -> expand -> reshape``."""
    chain: list[torch.fx.Node] = []
    cur = start
    expanded = False
    while cur.op == "call_function" and cur.args and isinstance(cur.args[0], torch.fx.Node):
        packet = _packet(cur)
        allowed = _INSERT_DIM_OPS if expanded else _CHAIN_OPS
        if packet not in allowed:
            break
        chain.append(cur)
        expanded = expanded or packet in _EXPANSION_OPS
        cur = cur.args[0]
    if not expanded:
        return [], start
    return chain, cur


def _broadcasts_kv(node: torch.fx.Node, q: torch.fx.Node, k: torch.fx.Node, k_chain: list[torch.fx.Node]) -> bool:
    """Whether the SDPA call reads K with fewer heads than Q, unexpanded and without ``enable_gqa``."""
    if k_chain or bool(_arg(node, 7, "enable_gqa")):
        return False
    return str(k.meta["val"].shape[1]) != str(q.meta["val"].shape[1])


def _ancestors(roots: list[torch.fx.Node], attention_inputs: Optional[dict[torch.fx.Node, list[torch.fx.Node]]] = None
               ) -> set[torch.fx.Node]:
    """Every node ``roots`` depend on; through an attention site's node (``attention_inputs``: its query,
    key and value) not through its mask (a later layer's query depends on the earlier layer's attention
    output, not on how its mask was built)."""
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    through = attention_inputs or {}
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(through.get(n, n.all_input_nodes))
    return seen


def _module_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _logits_nodes(graph: torch.fx.Graph) -> frozenset[str]:
    """The LM head matmul and the views/casts between it and the graph output."""
    out = next(n for n in graph.nodes if n.op == "output")
    first = out.args[0]
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if not isinstance(first, torch.fx.Node):
        return frozenset()
    found: list[str] = []
    cur = first
    for _ in range(_MAX_LOGITS_HOPS):
        if cur.op != "call_function":
            return frozenset()
        found.append(cur.name)
        if _packet(cur) in _LOGITS_MATMULS:
            return frozenset(found)
        head = cur.args[0] if cur.args else None
        if _packet(cur) is aten.cat and isinstance(head, (list, tuple)) and head:
            found += [p.name for p in head[1:] if isinstance(p, torch.fx.Node)]    # the other shards' pieces
            head = head[0]
        if cur.target is operator.getitem and isinstance(head, torch.fx.Node):
            pass                                                                    # a piece of the chunk
        elif _packet(cur) not in _LOGITS_TAIL_OPS | _LOGITS_GATHER_OPS:
            return frozenset()
        if not isinstance(head, torch.fx.Node):
            return frozenset()
        cur = head
    return frozenset()


def serving_model(program: Program, probe_windows: bool = True) -> ServingModel:
    """Read the serving roles of ``program``'s nodes (see the module docstring)."""
    from boomfx.serving.cache_inputs import find_cache_source, reads_a_buffer_cache
    if program.options.train:
        raise ServingModelError("serving needs an inference program, not a training step")
    graph = program.graph
    sdpa = [n for n in graph.nodes if n.op == "call_function" and _packet(n) in SDPA_OPS]
    eager = {e.output: e for e in eager_attentions(program)}
    if not sdpa and not eager:
        raise ServingModelError("no attention in the graph: boomfx serve needs a decoder whose attention is exported "
                                "as scaled_dot_product_attention (transformers: attn_implementation='sdpa') or "
                                "written out as matmul -> softmax -> matmul (attn_implementation='eager')")
    if sdpa and eager:
        raise ServingModelError(f"the graph mixes SDPA calls ({sdpa[0].name}) with attention written out as ops "
                                f"({next(iter(eager)).name}); one kind per model is modelled")
    try:
        batch, seq = program.symbol("batch"), program.symbol("seq")
    except KeyError:
        if any(reads_a_buffer_cache(program, _expansion_chain(k)[1]) for k in
               (_arg(n, 1, "key") for n in sdpa) if isinstance(k, torch.fx.Node)):
            raise ServingModelError("the attention reads a KV cache held in buffers updated in place (a StaticCache "
                                    "export: batch and sequence fixed); export the decode step with the cache as "
                                    "inputs (a DynamicCache) or export model(input_ids)") from None
        raise ServingModelError("the export needs a dynamic batch and sequence dimension "
                                "(dynamic_shapes={'input_ids': {0: Dim('batch'), 1: Dim('seq')}})") from None
    sites: list[AttentionSite] = []
    replaced: set[torch.fx.Node] = set()
    qkv_bases: list[torch.fx.Node] = []
    masks: dict[str, torch.fx.Node] = {}
    cache_writes: set[str] = set()
    rewraps: set[str] = set()
    pasts: set[str] = set()
    names = {n.name: n for n in graph.nodes}
    attention_inputs: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in sdpa or list(eager):
        if node in eager:      # written out: its matmuls' operands, the scores between them attention-side
            e = eager[node]
            q, k, v, mask = e.query, e.key, e.value, e.mask
            replaced.update(e.between | {e.scores})
        else:
            q, k, v = (_arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
            mask = _arg(node, 3, "attn_mask")
        if not all(isinstance(t, torch.fx.Node) for t in (q, k, v)):
            raise ServingModelError(f"{node.name}: query, key and value must be graph values")
        attention_inputs[node] = [q, k, v]   # type: ignore[list-item]
        k_chain, k_base = _expansion_chain(k)   # type: ignore[arg-type]
        v_chain, v_base = _expansion_chain(v)   # type: ignore[arg-type]
        replaced.update(k_chain, v_chain)
        replaced.add(node)
        if isinstance(mask, torch.fx.Node):
            masks[node.name] = mask
        qv, kv, vv = q.meta["val"], k_base.meta["val"], v_base.meta["val"]   # type: ignore[union-attr]
        if qv.dim() != 4 or kv.dim() != 4 or vv.dim() != 4:
            raise ServingModelError(f"{node.name}: expected [batch, heads, seq, head_dim] attention inputs")
        cache_inputs: tuple[str, ...] = ()
        k_src = find_cache_source(program, k_base)   # type: ignore[arg-type]
        v_src = find_cache_source(program, v_base)   # type: ignore[arg-type]
        if k_src is not None and v_src is not None:
            # the KV-cache shape is the cached tensors' own; the concatenations are the model's cache write
            cache_inputs = (k_src.placeholder, v_src.placeholder)
            cache_writes.update(k_src.chain + v_src.chain)
            rewraps.update(k_src.rewrap + v_src.rewrap)
            pasts.update({str(k_src.past), str(v_src.past)})
            kv, vv = names[k_src.placeholder].meta["val"], names[v_src.placeholder].meta["val"]
        elif str(kv.shape[2]) != str(qv.shape[2]):
            if reads_a_buffer_cache(program, k_base):   # type: ignore[arg-type]
                raise ServingModelError(f"{node.name}: its keys come from a cache buffer updated in place (a "
                                        "StaticCache export fixes batch and sequence); export the decode step with "
                                        "the cache as inputs (a DynamicCache) or export model(input_ids)")
            raise ServingModelError(f"{node.name}: key length {kv.shape[2]} differs from the query's {qv.shape[2]} "
                                    "and no past key/value input feeds it; export model(input_ids) or pass the "
                                    "cache as [batch, kv_heads, past, head_dim] inputs")
        qkv_bases.extend([q, k_base, v_base])   # type: ignore[list-item]
        sites.append(AttentionSite(
            node=node.name, module=_module_of(node), q_heads=_int(qv.shape[1], "query head count", node),
            kv_heads=_int(kv.shape[1], "KV head count", node), head_dim=_int(kv.shape[3], "head size", node),
            v_head_dim=_int(vv.shape[3], "value head size", node), dtype=kv.dtype,
            causal=(node not in eager and bool(_arg(node, 5, "is_causal"))) or isinstance(mask, torch.fx.Node),
            cache_inputs=cache_inputs, broadcast_kv=node not in eager and _broadcasts_kv(node, q, k, k_chain),
            eager=node in eager, score_passes=eager[node].extra_score_passes if node in eager else 0))
    past = _past_symbol(program, pasts, sites)
    mask_only = _ancestors(list(masks.values())) - _ancestors(qkv_bases, attention_inputs)
    replaced.update(n for n in mask_only if n.op == "call_function")
    replaced.update(names[n] for n in cache_writes)
    if probe_windows and masks:
        sites = _with_windows(program, sites, masks, batch, seq, past)
    weights = 0
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr") and program.input_roles.get(n.name) in (ROLE_PARAM, ROLE_BUFFER,
                                                                                      ROLE_CONSTANT):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                weights += val.numel() * val.element_size()
    logits = _logits_nodes(graph) - {n.name for n in replaced}
    return ServingModel(program, tuple(sites), frozenset(n.name for n in replaced), frozenset(logits), weights,
                        batch, seq, _module_calls(graph), past, frozenset(cache_writes), frozenset(rewraps))


def _past_symbol(program: Program, pasts: set[str], sites: list[AttentionSite]) -> Optional[SymbolInfo]:
    """The one symbol every cache input's length is (None without cache inputs)."""
    if not pasts:
        return None
    if any(not s.cache_inputs for s in sites):
        raise ServingModelError("some attention layers read cache inputs and others do not; only exports where "
                                "every layer carries its cache are modelled")
    if len(pasts) != 1:
        raise ServingModelError(f"the cache inputs' lengths differ ({', '.join(sorted(pasts))}); give them one "
                                "Dim (dynamic_shapes) so that every layer caches the same context")
    name = next(iter(pasts))
    if name not in program.symbols:
        raise ServingModelError(f"the cache inputs' length is {name}, not a dynamic dimension: export the cached "
                                "length with a Dim('past')")
    return program.symbols[name]


def _with_windows(program: Program, sites: list[AttentionSite], masks: dict[str, torch.fx.Node], batch: SymbolInfo,
                  seq: SymbolInfo, past: Optional[SymbolInfo]) -> list[AttentionSite]:
    """The sites with the sliding window each one's mask shows (``boomfx/serving/sliding_window.py``)."""
    import dataclasses

    from boomfx.passes.mask_probe import MAX_PROBE_TOKENS
    from boomfx.serving.sliding_window import probe_windows
    bindings = {batch.symbol: 1}
    if past is not None:   # a decode step: one query over a long cached context
        top = past.max_value if past.max_value is not None else MAX_PROBE_TOKENS
        bindings.update({seq.symbol: max(1, seq.min_value), past.symbol: max(past.min_value,
                                                                              min(top, MAX_PROBE_TOKENS))})
    else:
        top = seq.max_value if seq.max_value is not None else MAX_PROBE_TOKENS
        bindings[seq.symbol] = max(seq.min_value, min(top, MAX_PROBE_TOKENS))
    for info in program.symbols.values():   # anything else at its smallest
        bindings.setdefault(info.symbol, max(1, info.min_value))
    windows = probe_windows(program, masks, bindings)
    return [dataclasses.replace(s, sliding_window=windows.get(s.node)) for s in sites]


def _module_calls(graph: torch.fx.Graph) -> int:
    """How many module ``forward`` calls the traced forward made: the distinct entries of every node's
    ``nn_module_stack`` (each entry is one module instance on the call path; export keys repeated
    calls of one instance apart with a ``@n`` suffix)."""
    seen: set[str] = set()
    for n in graph.nodes:
        for key in (n.meta.get("nn_module_stack") or {}):
            seen.add(key)
    return len(seen)
