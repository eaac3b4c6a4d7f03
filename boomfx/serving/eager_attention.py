"""Attention written out as ops (``matmul -> scale -> mask -> softmax -> matmul``), found as one site.

Why: ``transformers`` runs some decoders only through its eager attention (Gemma-2 and GPT-OSS, whose
logit soft-capping and attention sinks SDPA cannot express: ``_supports_sdpa = False``), and
hand-written models (nanoGPT's slow path) do the same. A serving engine does not run those ops: vLLM's
attention kernel takes the scale, the soft-cap and the sinks as arguments and reads the paged cache.
So an eager attention is one attention site like an SDPA call: its query, key and value are the
two matmuls' operands, and everything between them (the ``[B, H, S, S]`` scores, their scaling,
soft-capping, sink logits, mask and softmax) is attention-side.

A site is recognised from its softmax over the last dim: the matmul ahead of it (within
``_MAX_HOPS`` ops, the query times the key transposed on its last two dims) and the matmul after it
(the probabilities, through casts, dropout and a slice that drops sink columns, times the value).
The score nodes are the ones both between the two matmuls (descendants of the first, ancestors of the
second); the mask is the tensor those nodes add (or ``where``/``masked_fill``) that is not a
parameter (sinks are).

Known limitations: a softmax whose scores come from more than one matmul (relative-position
attention adding a second ``q @ r`` product) is not a site; the model is then refused as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx

from boomfx.core.program import ROLE_PARAM, Program

aten = torch.ops.aten

_MAX_HOPS = 8
_MATMULS = frozenset({aten.matmul, aten.bmm})
# between the softmax and the value matmul: casts, dropout (identity at inference), the slice that
# drops the sink column (GPT-OSS)
_AFTER_SOFTMAX = frozenset({aten.to, aten._to_copy, aten.dropout, aten.native_dropout, aten.type_as, aten.slice,
                            aten.contiguous, aten.clone, aten.alias, aten.detach})
_MASK_OPS = frozenset({aten.add, aten.where, aten.masked_fill})
_SOFTMAX = frozenset({aten.softmax, aten._softmax, aten._safe_softmax})
_TRANSPOSE_OPS = frozenset({aten.transpose, aten.permute, aten.t})
_NO_KERNEL = frozenset({aten.view, aten.reshape, aten._unsafe_view, aten.slice, aten.alias, aten.expand,
                        aten.unsqueeze, aten.squeeze, aten.transpose, aten.permute, aten.detach,
                        aten._assert_tensor_metadata, aten.dropout, aten.select})


@dataclass(frozen=True)
class EagerAttention:
    """One attention written out: its two matmuls, its inputs, and the nodes between them."""

    scores: torch.fx.Node        # q @ k^T
    output: torch.fx.Node        # probs @ v (the site's node)
    query: torch.fx.Node
    key: torch.fx.Node           # before the transpose
    value: torch.fx.Node
    mask: Optional[torch.fx.Node]
    between: frozenset[torch.fx.Node]   # the scores' scaling, soft-cap, sinks, mask, softmax and casts

    @property
    def extra_score_passes(self) -> int:
        """Kernels over the scores beyond SDPA's math path (its matmuls, one mask add, one softmax): the
        scale applied to the scores instead of the query, soft-capping's div/tanh/mul, the sink column's
        concatenation and max, dtype casts. Views, an inference dropout and same-dtype casts launch none."""
        passes, mask_add = 0, False
        for n in self.between:
            packet = _packet(n)
            if packet in _SOFTMAX or packet in _NO_KERNEL or not isinstance(n.meta.get("val"), torch.Tensor):
                continue
            if packet in (aten.to, aten._to_copy, aten.type_as) and isinstance(n.args[0], torch.fx.Node) \
                    and n.args[0].meta["val"].dtype == n.meta["val"].dtype:
                continue
            if packet in _MASK_OPS and self.mask is not None and self.mask in n.all_input_nodes and not mask_add:
                mask_add = True       # the math path's own mask add
                continue
            passes += 1
        return passes


def _packet(node: torch.fx.Node) -> object:
    return getattr(node.target, "overloadpacket", None)


def _is_4d(node: object) -> bool:
    val = getattr(node, "meta", {}).get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 4


def _last_two_swapped(node: torch.fx.Node) -> bool:
    """``node`` is ``x.transpose(-2, -1)`` of a 4-D ``x`` (or ``x.transpose(2, 3)``, a permute of the same)."""
    if node.op != "call_function" or _packet(node) not in _TRANSPOSE_OPS or not _is_4d(node.args[0]):
        return False
    if _packet(node) is aten.transpose:
        return {int(d) % 4 for d in node.args[1:3]} == {2, 3}
    if _packet(node) is aten.permute:
        return [int(d) % 4 for d in node.args[1]] == [0, 1, 3, 2]
    return False


def _score_matmul(softmax: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The one ``q @ k^T`` matmul within ``_MAX_HOPS`` ops ahead of ``softmax`` (None: none, or several)."""
    found: set[torch.fx.Node] = set()
    frontier, seen = [softmax], {softmax}
    for _ in range(_MAX_HOPS):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a in seen or a.op != "call_function":
                    continue
                seen.add(a)
                if _packet(a) in _MATMULS:
                    found.add(a)
                else:
                    nxt.append(a)
        frontier = nxt
    if len(found) != 1:
        return None
    (mm,) = found
    if not (_is_4d(mm) and len(mm.args) >= 2 and isinstance(mm.args[1], torch.fx.Node)
            and _last_two_swapped(mm.args[1])):
        return None
    return mm


def _value_matmul(softmax: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The matmul whose first operand is ``softmax``'s output through casts, dropout and slices."""
    cur = softmax
    for _ in range(_MAX_HOPS):
        users = list(cur.users)
        mms = [u for u in users if _packet(u) in _MATMULS and u.args[0] is cur]
        if len(mms) == 1 and _is_4d(mms[0]):
            return mms[0]
        nxt = [u for u in users if _packet(u) in _AFTER_SOFTMAX and u.args[0] is cur]
        if len(nxt) != 1:
            return None
        cur = nxt[0]
    return None


def _between(first: torch.fx.Node, last: torch.fx.Node) -> frozenset[torch.fx.Node]:
    """Nodes that descend from ``first`` and lead to ``last`` (both excluded)."""
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    down: set[torch.fx.Node] = set()
    stack = [first]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in down and order[u] < order[last]:
                down.add(u)
                stack.append(u)
    up: set[torch.fx.Node] = set()
    stack = [last]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a in down and a not in up:
                up.add(a)
                stack.append(a)
    return frozenset(up)


def eager_attentions(program: Program) -> list[EagerAttention]:
    """Every attention of ``program`` written out as ops, in graph order."""
    out = []
    for sm in program.graph.nodes:
        if sm.op != "call_function" or _packet(sm) not in _SOFTMAX:
            continue
        scores, output = _score_matmul(sm), _value_matmul(sm)
        if scores is None or output is None or not isinstance(output.args[1], torch.fx.Node):
            continue
        between = _between(scores, output)
        if sm not in between:
            continue
        masks = {a for n in between if _packet(n) in _MASK_OPS for a in n.all_input_nodes
                 if a not in between and a is not scores and _is_4d(a)
                 and not (a.op == "placeholder" and program.input_roles.get(a.name) == ROLE_PARAM)}
        out.append(EagerAttention(scores, output, scores.args[0], scores.args[1].args[0], output.args[1],
                                  next(iter(masks)) if len(masks) == 1 else None, between))
    return out
