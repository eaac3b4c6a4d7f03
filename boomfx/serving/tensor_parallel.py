"""Tensor-parallel serving: the forward one TP rank runs, and the time of its collectives.

vLLM shards a decoder over ``--tensor-parallel-size`` GPUs of one node the Megatron way: q/k/v and
gate/up are ``ColumnParallelLinear`` (``out / tp`` rows each), o and down ``RowParallelLinear``
(``in / tp`` columns, an all-reduce of the partial output), the token embedding a
``VocabParallelEmbedding`` (``vocab / tp`` rows, masked ids, an all-reduce) and the LM head a
``ParallelLMHead`` whose logits are all-gathered before sampling; norms stay whole. That is the
sharding ``boomfx/distributed/tensor_parallel.py`` already applies to a forward export with the
vocabulary-parallel ends (``--tp-plan torchtitan``), so ``tp_serving_program`` reuses its walk on the
inference export, re-derives every shape with the export's own fake-tensor mode (the export keeps its
``aten.linear`` / ``scaled_dot_product_attention`` nodes, which ``boomfx/serving/model.py`` reads) and
lowers the TP custom ops to ``_c10d_functional`` all_reduce / all_gather + wait.

``CollectiveTimes`` prices those nodes with the collective model (``kernels_db/collectives.py``: the
``--db``'s measured rows, else NCCL's ring/tree on the device's NVLink) for a group of ``tp`` ranks on
one node: two all-reduces per layer of ``tokens x hidden`` plus the embedding's, and the logits'
all-gather per sampled token.

Known limitations:
- NB: vLLM's custom all-reduce (one-shot / two-shot over NVLink for messages up to a few MiB, used
  instead of NCCL for most decode steps) is priced as NCCL's; it is faster for small messages.
- NB: KV heads fewer than ``tp`` (vLLM replicates them) cannot be split by the walk: such models keep
  TP=1 step times, with a warning (``tp_serving_program`` raises, ``serve.setup`` says why).
- NB: mixture-of-experts models (stacked ``[experts, out, in]`` weights, split by vLLM's ``FusedMoE``)
  are not cut either: TP=1 step times with the same warning.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from boomfx.core.errors import OptionError
from boomfx.core.program import Program
from boomfx.passes.specs import to_sympy

c10d = torch.ops._c10d_functional
_COLLECTIVES = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
}


def tp_serving_program(program: Program, tp: int) -> Program:
    """The inference program of one of ``tp`` ranks (module docstring); OptionError when the model's
    heads, KV heads or widths do not split ``tp`` ways or an op's split cannot be followed."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from boomfx.distributed import tp_ops
    from boomfx.distributed.model_shape import model_shape
    from boomfx.distributed.plan import ParallelConfig, check_against_model
    from boomfx.distributed.tensor_parallel import module_plan, shard_export

    ep = program.export
    if ep is None:
        raise OptionError("--tensor-parallel-size: the rank's program is cut from the export; capture the "
                          "program from a .pt2 file or an ExportedProgram")
    _refuse_stacked_experts(program)
    cfg = ParallelConfig(tp=tp, vocab_parallel=True, gpus_per_node=tp)
    check_against_model(cfg, model_shape(program, cfg))
    sharded = shard_export(ep, module_plan(program, cfg), tp)
    placeholders = [n for n in sharded.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([n.meta["val"] for n in placeholders])
    # the walk's split weights are plain meta tensors; an export on the CPU holds fake CPU ones
    device = {n.name: n.meta["val"].device for n in ep.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    for n in placeholders:
        val = n.meta["val"]
        if isinstance(val, torch.Tensor) and not isinstance(val, FakeTensor) and n.name in device:
            with mode:
                n.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device=device[n.name])
    values = [n.meta["val"] for n in placeholders]
    FakeTensorProp(sharded.graph_module, mode).propagate_dont_convert_inputs(*values)
    local = Program(sharded.graph_module, program.symbols, program.input_roles, program.options,
                    param_names=program.param_names, source=program.source)
    return tp_ops.lower_tp_ops(local)


def _refuse_stacked_experts(program: Program) -> None:
    """vLLM's ``FusedMoE`` splits every expert's intermediate dimension over the TP ranks; the walk
    keeps a mixture-of-experts' stacked ``[experts, out, in]`` weights whole (and its router
    replicated), which would price each rank with all the experts' work and weights."""
    from boomfx.core.program import ROLE_PARAM

    for node in program.graph.nodes:
        val = node.meta.get("val")
        if (node.op == "placeholder" and program.input_roles.get(node.name) == ROLE_PARAM
                and isinstance(val, torch.Tensor) and val.dim() == 3):
            name = program.param_names.get(node.name, node.name)
            raise OptionError(f"--tensor-parallel-size: the experts' stacked weight {name} {list(val.shape)} is not "
                              "split the way vLLM's FusedMoE splits it (each expert's intermediate over the ranks)")


class CollectiveTimes:
    """Time of the TP collectives of one rank's program at a binding (module docstring)."""

    def __init__(self, program: Program, device: Any, tp: int, db: Optional[str] = None) -> None:
        from boomfx.kernels_db.collective_model import ClusterTopology, CollectiveGroup
        from boomfx.kernels_db.collectives import CollectivePricer
        from boomfx.kernels_db.db_path import resolve_db_path
        from boomfx.kernels_db.store import Store

        path = resolve_db_path(db, device)
        self._pricer = CollectivePricer(Store(path) if path is not None else None, device)
        self._group = CollectiveGroup(tuple(range(tp)), ClusterTopology(1, tp))
        self.nodes: dict[str, fx.Node] = {n.name: n for n in program.graph.nodes
                                          if n.op == "call_function" and n.target in _COLLECTIVES}

    def __contains__(self, name: str) -> bool:
        return name in self.nodes

    def message_bytes(self, name: str, ev: Any) -> int:
        """The collective's whole buffer (nccl-tests' size): the reduced tensor, or the gathered output."""
        val = self.nodes[name].meta["val"]
        return int(ev(to_sympy(val.numel()))) * val.element_size()

    def time_ns(self, name: str, ev: Any) -> tuple[float, str]:
        """(time, provenance) of collective ``name`` with the sizes ``ev`` binds."""
        op = _COLLECTIVES[self.nodes[name].target]
        nbytes = self.message_bytes(name, ev)
        price = self._pricer.price(op, nbytes, self._group, str(self.nodes[name].meta["val"].dtype).replace("torch.", ""))
        return price.time_ns, f"collective {price.source.value}"

