"""Attention as transformers' eager SDPA path calls it: ``is_causal`` and no mask, and the key/value heads
unrepeated with ``enable_gqa``, where the export built a causal mask and repeated the heads.

Why: ``transformers`` decides at run time (``masking_utils._ignore_causal_mask_sdpa``,
``integrations/sdpa_attention.py``). Eagerly, without padding (no attention mask, or one of ones) and
with as many queries as keys, it builds no mask and calls ``scaled_dot_product_attention(...,
is_causal=True)``, and with no mask it passes the key/value heads as they are with ``enable_gqa=True``
(head size <= 256). While traced (torch.export counts) it cannot skip: the export builds a ``[b, 1, q,
kv]`` causal mask and calls SDPA with it, on keys and values repeated to the query heads
(``repeat_kv``). Priced as exported, a 2-layer Llama (hidden 256, 4 heads, 2 KV heads) at one
sequence of 2048 tokens on this VM's CPU was predicted 189 ms against 132 ms measured (+43%): SDPA
91 ms against 35 ms in situ (the masked kernel computes every score and reads the mask, the causal one
skips the upper triangle).

So for eager inference (``ProgramOptions.runs_eager_module``) each SDPA call whose mask is causal, or
sees every key, at a probe of the export's sizes (``passes/mask_probe.py``: the mask's subgraph run on
token ids and attention masks of ones at batch 1 and ``MAX_PROBE_TOKENS`` tokens) gets no mask and
``is_causal`` (False for a mask that hides nothing); its keys and values, where they are a
``repeat_kv`` of fewer heads, are those heads with ``enable_gqa=True``. The mask and the repeats are
then dead code and leave the graph. Same output (tests/test_eager_sdpa.py).

A re-traced step (``--train``, ``--amp``; ``traces_eager_attention``: with ``python_locals``, not
``--compile``) is traced from the export rewritten so (``eager_attention_export``, called by
``capture.trace_step``, so the per-rank re-traces of ``boomfx/distributed`` get it too, after their own
sharding): its backward and saved tensors are then the eager module's, which saves no mask and takes the
key/value gradients on the unrepeated heads (CPU flash attention, forward and backward). As exported, the
2-layer decoders of ``benchmarks/cpu_accuracy.py`` at batch 4 x 128 tokens were predicted over the module's
profiler peak (foreach AdamW) by +3.3% (Llama), +3.1% (Qwen3), +1.1% (Qwen2), +0.9% (GPT-2), and 12 more of
``broad_cpu_accuracy`` by +1.0..+3.7%; since, all these and Mistral (its 64-token window keeps its mask, as
the module does), Falcon and MPT are on it to the byte (tests/test_eager_sdpa_training.py). On a CUDA target
the step's SDPA is then the kernel CUDA picks for the eager call (``training/amp.gpu_sdpa``, after torch's
``sdp_utils.cpp``; not measured on a GPU): flash attention, which takes GQA's fewer heads, in bf16/fp16; in
fp32 the math kernel where the heads are unrepeated (memory-efficient attention takes no GQA), where the
export's masked call was memory-efficient.

Known limitations:
- NB: ``--no-python-locals`` keeps the export's mask and repeats (``ep.module()`` runs the mask, and
  ``boomfx validate`` measures it), so do ``--compile`` (under torch < 2.14 dynamo never lets transformers
  skip the mask) and ``boomfx serve`` (the engine's own attention).
- NB: the probe decides for every size: a sliding window of at least ``MAX_PROBE_TOKENS`` (or of the
  export's whole sequence range) looks causal and is priced as causal attention at every length, and a
  shorter one keeps the mask at every length, though the eager module skips it while the sequence is
  shorter than the window (Mistral's 4096 tokens in an export up to 8191: masked at 2048).
- NB: padding is assumed absent: an export with an attention-mask input is probed with a mask of ones, as
  the eager module skips a mask of ones; a real padded batch keeps its mask.
"""
from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, Mapping, Optional

import sympy
import torch
import torch.fx

from boomfx.core.program import Program, ProgramOptions, SymbolInfo
from boomfx.passes.mask_probe import MAX_PROBE_TOKENS, run_mask, visible

SDPA = torch.ops.aten.scaled_dot_product_attention.default
# transformers passes enable_gqa only for head sizes up to this (use_gqa_in_sdpa)
GQA_MAX_HEAD_SIZE = 256
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.clone.default, torch.ops.aten.contiguous.default}
_INSERTS = {torch.ops.aten.unsqueeze.default, torch.ops.aten.slice.Tensor, torch.ops.aten.alias.default}


def eager_attention_calls(program: Program) -> Program:
    """``program`` with its SDPA calls as the eager module makes them (see the module doc), on a copy of its
    graph, or ``program`` itself when no call changes."""
    sites = [n for n in program.graph.nodes if n.op == "call_function" and n.target is SDPA
             and isinstance(_arguments(n)["attn_mask"], torch.fx.Node) and not _arguments(n)["is_causal"]]
    if not sites:
        return program
    bindings = _probe_bindings(program)
    kinds: dict[torch.fx.Node, Optional[bool]] = {}       # mask -> causal (True), hides nothing (False), other
    for site in sites:
        mask = _arguments(site)["attn_mask"]
        if mask not in kinds:
            with torch.no_grad():
                value = run_mask(program, mask, bindings)
            kinds[mask] = _kind(value) if value is not None else None
    chosen = [s for s in sites if kinds[_arguments(s)["attn_mask"]] is not None and _same_length(s)]
    if not chosen:
        return program
    graph, copies = program.copied_graph()
    for site in chosen:
        node = copies[site]
        args = _arguments(node)
        args["attn_mask"], args["is_causal"] = None, kinds[_arguments(site)["attn_mask"]]
        key, value = _unrepeated(args["key"]), _unrepeated(args["value"])
        if key is not None and value is not None and _gqa_allowed(args["query"], key, value):
            args["key"], args["value"], args["enable_gqa"] = key, value, True
        node.args = (args.pop("query"), args.pop("key"), args.pop("value"))
        node.kwargs = args
    graph.eliminate_dead_code()
    return program.rewritten(graph, export=program.export)


def traces_eager_attention(options: ProgramOptions) -> bool:
    """Whether a step re-traced from the export (``--train``, ``--amp``) is traced from the export with the eager
    module's SDPA calls (``eager_attention_export``): as the nn.Module runs eagerly (``python_locals``), not
    compiled (torch < 2.14's dynamo never lets transformers skip the mask) and not the export's graph
    (``--no-python-locals``: ``ep.module()``, what ``boomfx validate`` runs)."""
    return options.python_locals and not options.compile and (options.train or options.amp is not None)


# per export graph (held weakly), its rewritten export (None: no call changes): the steps of one export share it,
# so the truncated trace kept per export graph (training/truncate.py) serves them all (a search's depth probes)
_EXPORTS: "weakref.WeakKeyDictionary[torch.fx.GraphModule, Optional[SimpleNamespace]]" = weakref.WeakKeyDictionary()


def eager_attention_export(ep: Any, symbols: Mapping[str, SymbolInfo], roles: Mapping[str, str]) -> Any:
    """``ep`` (an ExportedProgram, or the duck-typed export a rewrite builds) with its SDPA calls as the eager
    module makes them (``eager_attention_calls`` on its graph), as a duck-typed export (what
    ``training._trace`` reads) to trace a step from, so that the step's backward and saved tensors are the
    eager module's: no mask, the unrepeated key/value heads. ``ep`` itself when no call changes.
    ``symbols``/``roles``: the export's (``capture.symbols_of``, ``capture.export_roles``)."""
    gm = ep.graph_module
    if gm not in _EXPORTS:
        program = eager_attention_calls(Program(gm, symbols, roles))
        out = None
        if program.gm is not gm:
            fields = dict(vars(ep)) if isinstance(ep, SimpleNamespace) else {
                "graph_signature": ep.graph_signature, "range_constraints": ep.range_constraints,
                "state_dict": ep.state_dict}
            fields.update(graph=program.graph, graph_module=program.gm)
            out = SimpleNamespace(**fields)
        _EXPORTS[gm] = out
    out = _EXPORTS[gm]
    return ep if out is None else out


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """Every SDPA argument by its schema name (defaults filled in)."""
    names = [a.name for a in SDPA._schema.arguments]
    out = {a.name: a.default_value if a.has_default_value() else None for a in SDPA._schema.arguments}
    out.update(zip(names, node.args))
    out.update(node.kwargs)
    return out


def _probe_bindings(program: Program) -> dict[sympy.Symbol, int]:
    """Batch 1 and ``MAX_PROBE_TOKENS`` for every other size, each within its range."""
    out = {}
    for info in program.symbols.values():
        want = 1 if info.role == "batch" else MAX_PROBE_TOKENS
        high = info.max_value if info.max_value is not None else want
        out[info.symbol] = max(info.min_value or 1, min(want, high))
    return out


def _kind(mask: torch.Tensor) -> Optional[bool]:
    """True for a causal mask (every query sees itself and the keys before it), False for one that hides
    nothing, None otherwise (a window, padding, a bias)."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return None
    if mask.dtype != torch.bool:
        finite = mask[visible(mask)]
        if finite.numel() and bool(finite.abs().max() > 0):     # an additive bias, not only a mask
            return None
    seen = visible(mask).reshape(-1, mask.shape[-2], mask.shape[-1])
    if bool(seen.all()):
        return False
    causal = torch.ones(mask.shape[-2], mask.shape[-1], dtype=torch.bool).tril()
    return True if bool((seen == causal).all()) else None


def _shape(node: Any) -> Optional[tuple]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _same_length(site: torch.fx.Node) -> bool:
    """As many queries as keys (no cache): the eager module's condition for skipping the mask."""
    args = _arguments(site)
    q, k = _shape(args["query"]), _shape(args["key"])
    return q is not None and k is not None and len(q) == len(k) == 4 and _equal(q[2:3], k[2:3])


def _unrepeated(node: Any) -> Optional[torch.fx.Node]:
    """The ``[b, kv_heads, s, d]`` tensor that ``node`` repeats to more heads (transformers' ``repeat_kv``:
    an unsqueeze at dim 2, an expand, a reshape), or None."""
    out = _shape(node)
    n = node
    while isinstance(n, torch.fx.Node) and n.target in _VIEWS:
        n = n.args[0]
    if not isinstance(n, torch.fx.Node) or n.target is not torch.ops.aten.expand.default:
        return None
    expanded = _shape(n)
    src = n.args[0]
    while isinstance(src, torch.fx.Node) and src.target in _INSERTS:
        src = src.args[0]
    base = _shape(src)
    if out is None or expanded is None or base is None or len(expanded) != 5 or len(base) != 4:
        return None
    b, kv, rep, s, d = expanded
    if not _equal(base, (b, kv, s, d)) or not _equal(out, (b, kv * rep, s, d)):
        return None
    return src


def _equal(a: tuple, b: tuple) -> bool:
    def expr(x: Any) -> Any:
        return x.node.expr if isinstance(x, torch.SymInt) else sympy.sympify(x)
    return len(a) == len(b) and all(sympy.simplify(expr(x) - expr(y)) == 0 for x, y in zip(a, b))


def _gqa_allowed(query: Any, key: torch.fx.Node, value: torch.fx.Node) -> bool:
    """transformers' ``use_gqa_in_sdpa`` without a mask: equal head sizes up to 256; query heads a multiple."""
    q, k, v = _shape(query), _shape(key), _shape(value)
    if q is None or k is None or v is None:
        return False
    try:
        hq, hk, dk, dv = (int(x) for x in (q[1], k[1], k[3], v[3]))
    except (TypeError, ValueError):
        return False
    return dk == dv <= GQA_MAX_HEAD_SIZE and hk > 0 and hq % hk == 0
