"""What the parallel plan needs to know of the model, read from the export: layers, heads, TP plan.

The tensor-parallel plan is derived the way torchtitan writes it by hand: inside each entry of a
module list (each layer of the main layer list, and of an encoder-decoder's other stack), linear
weights whose module is named like an attention input projection (q/k/v) or an MLP input
projection (gate/up/fc) are split column-wise (output features), those named like an output
projection (o/down/fc_out) row-wise (input features). A user plan (``--tp-plan
'layers.*.q=colwise,...'``, fnmatch patterns on module paths) replaces the derived one. Fused
projections whose rows stack the parts the model then slices apart (Phi-3's ``qkv_proj`` and
``gate_up_proj``, GPT-2's ``c_attn``, MPT's ``Wqkv``, Baichuan's ``W_pack``) are ``colwise_packed``:
a plain column split would give one rank all of q and another k and v, so each rank holds 1/tp of
every part, as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` do (the parts' bounds
are read where the model splits the output: ``tensor_parallel._Sharder.packed``). GPT-2 names both
output projections ``c_proj``; each is rowwise beside its colwise ``c_fc`` or packed ``c_attn``.
GPT-NeoX's and Bloom's ``query_key_value`` interleave q, k and v per head, so a plain column split
keeps whole heads: it is colwise (a layout that stacks the parts instead, sliced on the split
dimension, is refused by the walk, never split wrong). With
``vocab_parallel`` (``--tp-plan torchtitan``) the token embedding is rowwise and the output head
colwise (``vocab_ends``).

Heads come from the attention op itself (``scaled_dot_product_attention``'s query is
``[batch, heads, seq, head_dim]``; the export's call where the step's runs as the math kernel's ops); key/value
heads from the k projection's width / head_dim.
"""

from __future__ import annotations

import fnmatch
import re
import weakref
from typing import Optional

import torch

from boomfx.training.checkpointing import find_layer_list, layer_names
from boomfx.distributed.plan import ModelShape, ParallelConfig
from boomfx.core.program import PHASE_FORWARD, ROLE_INPUT, ROLE_PARAM, Program

COLWISE_NAMES = frozenset(
    {
        "q",
        "k",
        "v",
        "q_proj",
        "k_proj",
        "v_proj",
        "query",
        "key",
        "value",
        "wq",
        "wk",
        "wv",
        "gate",
        "up",
        "gate_proj",
        "up_proj",
        "fc",
        "fc1",
        "fc_in",
        "c_fc",
        "w1",
        "w3",
        "dense_h_to_4h",
        "query_key_value",
        "wi",
        "wi_0",
        "wi_1",
        "relative_attention_bias",
    }
)
ROWWISE_NAMES = frozenset({"o", "o_proj", "out_proj", "wo", "down", "down_proj", "fc_out", "fc2", "w2",
                           "dense_4h_to_h"})
PACKED_QKV_NAMES = frozenset({"qkv_proj", "c_attn", "Wqkv", "W_pack"})  # q|k|v rows stacked
PACKED_NAMES = PACKED_QKV_NAMES | {"gate_up_proj"}  # gate|up rows stacked
COLWISE_STYLES = frozenset({"colwise", "colwise_packed"})  # both split the output features
GPT2_OUT = "c_proj"
GPT2_INPUTS = frozenset({"c_fc", "c_attn"})
ATTENTION_DENSE = "dense"
KEY_NAMES = frozenset({"k", "k_proj", "key", "wk"})
# per-head interleaved q|k|v (GPT-NeoX: view(b, t, heads, 3 x head_dim); Bloom: view(b, t, heads, 3, head_dim)):
# a plain column split keeps whole heads, and an attention ``dense`` beside it is rowwise
INTERLEAVED_QKV_NAMES = frozenset({"query_key_value"})
_SDPA = {
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}


def tp_plan(program: Program, cfg: Optional[ParallelConfig] = None) -> dict[str, str]:
    """Weight FQN -> "colwise" | "rowwise" | "colwise_packed" for every projected weight inside a module list's
    entries (``_inside_layer_list``)."""
    explicit = tuple(cfg.tp_plan) if cfg is not None else ()
    plan: dict[str, str] = {}
    ends = vocab_ends(program) if cfg is not None and cfg.vocab_parallel and not explicit else {}
    for name, fqn in program.param_names.items():
        if program.input_roles.get(name) != ROLE_PARAM or not fqn.endswith(".weight"):
            continue
        module = fqn[: -len(".weight")]
        val = _param_val(program, name)
        if val is None or val.dim() != 2:
            continue
        if explicit:
            for pattern, style in explicit:
                if fnmatch.fnmatchcase(module, pattern):
                    plan[fqn] = style
            continue
        if not _inside_layer_list(module):
            if cfg is not None and cfg.vocab_parallel and name in ends:
                plan[fqn] = ends[name]
            continue
        leaf = module.rsplit(".", 1)[-1]
        if leaf in COLWISE_NAMES:
            plan[fqn] = "colwise"
        elif leaf in PACKED_NAMES:
            plan[fqn] = "colwise_packed"
        elif leaf in ROWWISE_NAMES:
            plan[fqn] = "rowwise"
    if not explicit:
        _pair_gpt2_output_projections(plan, program)
        _pair_attention_dense(plan, program)
        _pair_bert_dense(plan, program)
        _keep_routers_replicated(plan)
    return plan


_LIST_ENTRY = re.compile(r"(?:^|\.)\d+\.")


def _inside_layer_list(module: str) -> bool:
    """Whether a module sits inside an entry of a module list (``model.layers.3.``, ``transformer.h.0.``,
    an encoder-decoder's ``encoder.layers.0.`` and ``decoder.layers.0.`` alike), where the derived plan
    splits projections; the main layer list alone would leave one of an encoder-decoder's stacks whole."""
    return _LIST_ENTRY.search(module + ".") is not None


def _pair_attention_dense(plan: dict[str, str], program: Program) -> None:
    """Phi names its attention's output projection ``dense``, beside colwise ``q_proj``/``k_proj``/``v_proj``
    (GPT-NeoX beside ``query_key_value``): rowwise there. Elsewhere ``dense`` is no output projection by
    name (BERT's ``intermediate.dense`` widens: ``_pair_bert_dense``)."""
    fqns = set(program.param_names.values())
    for fqn, style in list(plan.items()):
        parent, _, leaf = fqn[: -len(".weight")].rpartition(".")
        partner = f"{parent}.{ATTENTION_DENSE}.weight"
        if leaf in KEY_NAMES | INTERLEAVED_QKV_NAMES and style == "colwise" and partner in fqns and partner not in plan:
            plan[partner] = "rowwise"


def _pair_bert_dense(plan: dict[str, str], program: Program) -> None:
    """BERT-style layers (BERT, RoBERTa, ELECTRA) name three projections ``dense``: beside a colwise
    ``attention.self.key``, ``attention.output.dense`` is rowwise, ``intermediate.dense`` colwise and the
    layer's ``output.dense`` rowwise."""
    fqns = set(program.param_names.values())
    for fqn, style in list(plan.items()):
        if style != "colwise" or not fqn.endswith(".attention.self.key.weight"):
            continue
        layer = fqn[: -len(".attention.self.key.weight")]
        pairs = {f"{layer}.attention.output.dense.weight": "rowwise", f"{layer}.intermediate.dense.weight": "colwise",
                 f"{layer}.output.dense.weight": "rowwise"}
        if all(p in fqns for p in pairs):
            plan.update(pairs)


def _keep_routers_replicated(plan: dict[str, str]) -> None:
    """A ``gate`` with no rowwise linear beside it is a mixture-of-experts router (Mixtral's and
    Qwen-MoE's ``mlp.gate``: hidden -> experts, then a softmax over the experts), not a gated MLP's
    input projection; split, its expert scores would be cut across ranks. It stays replicated."""
    rowwise_parents = {fqn[: -len(".weight")].rpartition(".")[0] for fqn, s in plan.items() if s == "rowwise"}
    for fqn, style in list(plan.items()):
        parent, _, leaf = fqn[: -len(".weight")].rpartition(".")
        if leaf == "gate" and style == "colwise" and parent not in rowwise_parents:
            del plan[fqn]


def _pair_gpt2_output_projections(plan: dict[str, str], program: Program) -> None:
    """GPT-2 names both output projections ``c_proj``: the MLP's (beside a colwise ``c_fc``) and the
    attention's (beside a packed ``c_attn``) are rowwise."""
    fqns = set(program.param_names.values())
    for fqn, style in list(plan.items()):
        parent, _, leaf = fqn[: -len(".weight")].rpartition(".")
        partner = f"{parent}.{GPT2_OUT}.weight"
        if leaf in GPT2_INPUTS and style in COLWISE_STYLES and partner in fqns:
            plan[partner] = "rowwise"


def vocab_ends(program: Program) -> dict[str, str]:
    """torchtitan's vocabulary-parallel ends, by placeholder: the token embedding (an embedding
    looking up a model input) rowwise, the output head (the linear whose result the model returns)
    colwise."""
    aten = torch.ops.aten
    inputs = {n for n in program.graph.nodes if n.op == "placeholder" and program.input_roles.get(n.name) == ROLE_INPUT}
    ends: dict[str, str] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.embedding.default and node.args[1] in inputs:
            ends[node.args[0].name] = "rowwise"
    head = _returned_linear(program)
    if head is not None:
        ends[head] = "colwise"
    return ends


def _returned_linear(program: Program) -> Optional[str]:
    """The weight placeholder of the forward linear whose output the loss reads first (the head)."""
    aten = torch.ops.aten
    linears = [n for n in program.graph.nodes if n.op == "call_function" and n.target in (aten.linear.default, aten.mm.default, aten.addmm.default)
               and program.phases.get(n.name, PHASE_FORWARD) == PHASE_FORWARD]
    return None if not linears else _weight_placeholder(linears[-1])


def _weight_placeholder(node: "torch.fx.Node") -> Optional[str]:
    """The parameter placeholder a matmul's weight operand comes from (through t/transpose views and
    autocast's cast of the weight to the low dtype)."""
    aten = torch.ops.aten
    w = node.args[1] if node.target is aten.linear.default else node.args[-1]
    through = (aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default)
    while isinstance(w, torch.fx.Node) and w.op == "call_function" and w.target in through:
        w = w.args[0]
    return w.name if isinstance(w, torch.fx.Node) and w.op == "placeholder" else None


def _conv1d_weights(program: Program) -> set[str]:
    """Weights a forward ``addmm`` reads untransposed as its second matrix ([in, out], GPT-2's Conv1D)."""
    aten = torch.ops.aten
    names = {
        n.args[2].name
        for n in program.graph.nodes
        if n.op == "call_function" and n.target is aten.addmm.default and isinstance(n.args[2], torch.fx.Node)
        and n.args[2].op == "placeholder" and program.phases.get(n.name) == PHASE_FORWARD
    }
    return {program.param_names[n] for n in names if n in program.param_names}


def rowwise_outputs(program: Program) -> list[tuple[str, int, torch.dtype]]:
    """(FQN, output features, weight dtype) of every rowwise projection of the derived TP plan: each one's
    partial output is all-reduced in forward (``[tokens, output features]``)."""
    conv1d = _conv1d_weights(program)
    vals = {fqn: _param_val(program, name) for name, fqn in program.param_names.items()}
    out = []
    for fqn, style in tp_plan(program).items():
        if style == "rowwise" and vals.get(fqn) is not None:
            val = vals[fqn]
            out.append((fqn, int(val.shape[1 if fqn in conv1d else 0]), val.dtype))
    return out


def colwise_inputs(program: Program) -> list[tuple[str, int, torch.dtype]]:
    """(FQN, input features, weight dtype) of every colwise projection (packed ones too) of the derived TP
    plan: each one's input gradient is all-reduced in backward (``[tokens, input features]``)."""
    conv1d = _conv1d_weights(program)
    vals = {fqn: _param_val(program, name) for name, fqn in program.param_names.items()}
    out = []
    for fqn, style in tp_plan(program).items():
        if style in ("colwise", "colwise_packed") and vals.get(fqn) is not None:
            val = vals[fqn]
            out.append((fqn, int(val.shape[0 if fqn in conv1d else 1]), val.dtype))
    return out


def _embedding_weights(program: Program, by_input: Optional[bool] = None) -> set[str]:
    """FQNs of the weights an embedding looks up; ``by_input``: only those whose ids are (True) or are not
    (False) a model input (token embeddings; tables looked up by computed ids, such as T5's position bias)."""
    aten = torch.ops.aten
    names = {n.args[0].name for n in program.graph.nodes if n.op == "call_function" and n.target is aten.embedding.default
             and (by_input is None or by_input == (program.input_roles.get(getattr(n.args[1], "name", "")) == ROLE_INPUT))}
    return {program.param_names[n] for n in names if n in program.param_names}


def _param_val(program: Program, placeholder: str) -> Optional[torch.Tensor]:
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name == placeholder:
            val = node.meta.get("val")
            return val if isinstance(val, torch.Tensor) else None
    return None


# per GraphModule: a search asks for the shape of one program under hundreds of plans (0.5-2 s each on 80 layers)
_SHAPES: "weakref.WeakKeyDictionary[torch.fx.GraphModule, dict]" = weakref.WeakKeyDictionary()


def model_shape(program: Program, cfg: Optional[ParallelConfig] = None) -> ModelShape:
    """The program's layers and heads; with ``cfg.tp > 1`` (or no ``cfg``) its tensor-parallel projections.
    Depends on the config only through those two, so it is kept per program and (TP or not, TP plan)."""
    key = (cfg is None or cfg.tp > 1, tuple(cfg.tp_plan) if cfg is not None else (), len(program.graph.nodes))
    memo = _SHAPES.setdefault(program.gm, {})
    if key not in memo:
        memo[key] = _model_shape(program, cfg)
    return memo[key]


def _model_shape(program: Program, cfg: Optional[ParallelConfig]) -> ModelShape:
    prefix = find_layer_list(program.graph)
    layers = layer_names(program.graph, prefix) if prefix else []
    heads = head_dim = None
    # the step's attention kernel, else the export's SDPA call: a training step traced for CUDA runs the math
    # kernel, ops with no attention node, on fewer key/value heads in fp32 (passes/eager_sdpa.py)
    graphs = [program.graph] + ([program.export.graph] if program.export is not None else [])
    for node in (n for graph in graphs for n in graph.nodes):
        if node.op == "call_function" and node.target in _SDPA:
            q = node.args[0].meta.get("val")
            heads, head_dim = int(q.shape[1]), int(q.shape[-1])
            break
    projected: dict[str, tuple[str, int]] = {}
    kv_heads = None
    vals = {fqn: _param_val(program, name) for name, fqn in program.param_names.items()}
    if cfg is None or cfg.tp > 1:
        embeddings = _embedding_weights(program)
        tables = _embedding_weights(program, by_input=False)
        conv1d = _conv1d_weights(program)
        for fqn, style in tp_plan(program, cfg).items():
            val = vals[fqn]
            vocab_rows = style == "rowwise" and fqn in embeddings  # a vocabulary-parallel embedding
            in_out = fqn in conv1d or (style == "colwise" and fqn in tables)  # [in, out]; a per-head table's heads
            size = int(val.shape[(0 if style in COLWISE_STYLES or vocab_rows else 1) ^ int(in_out)])
            projected[fqn] = (style, size)
            leaf = fqn[: -len(".weight")].rsplit(".", 1)[-1]
            if leaf in KEY_NAMES and head_dim:
                kv_heads = size // head_dim
            elif leaf in PACKED_QKV_NAMES and style == "colwise_packed" and heads and head_dim:
                kv_heads = (size - heads * head_dim) // (2 * head_dim)  # q, then k and v of equal width
    return ModelShape(layers=len(layers), heads=heads, kv_heads=kv_heads, projected=projected)
