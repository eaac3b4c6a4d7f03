"""Find the model's repeated layers in an export graph and cut the graph into per-layer segments.

Why: activation checkpointing in real training wraps each block of the model's main layer list
(``layers.0``, ``h.3``, ``encoder.layer.2``...). An inference export is flat, but every node keeps
``meta["nn_module_stack"]``, so the layer list and each layer's contiguous run of nodes can be
recovered from module paths. :mod:`boomfx.training.trace` then runs each segment under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which is what eager code does.

Example::

    prefix = find_layer_list(ep.graph)            # "h"
    segments = plan_segments(ep.graph, prefix)    # [Segment("h.0", ...), Segment("h.1", ...)]
    some = checkpoint_segments(ep.graph, ["h.0", "h.2"])   # selective: only those instances

:class:`GraphRunner` replays an export graph op by op (so each traced op inherits the export node's
meta), applies boomfx.training.amp's GPU policies, and runs each segment under ``checkpoint``.

Known limitations:
    - The layer list is the ``<prefix>.<int>`` family with the most instances; models with two
      stacks of equal depth (encoder/decoder) get the one with more nodes only.
    - Selective checkpointing (``checkpoint_segments(graph, layers)``) picks instances of the main
      layer list only (names as module paths: ``h.0``, ``model.layers.3``).
    - A layer whose nodes are interleaved with other modules' nodes is split into several segments,
      each checkpointed on its own (still correct, but more inputs are saved).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.fx import traceback as fx_traceback

from torch._decomp import decomposition_table
from torch._dispatch.python import enable_python_dispatcher

from boomfx.passes.aliasing import is_inactive_dropout
from boomfx.training import amp as amp_policy
from boomfx.training.recurrent import RNN_OPS, output_feeds_matmul, run_recurrent
from boomfx.training.resize import RESIZE_OPS, run_resize
from boomfx.core.errors import OptionError
from boomfx.core.layers import clean_module_path, find_layer_list, layer_instance, stack_paths

aten = torch.ops.aten



@dataclass(frozen=True)
class Segment:
    """A contiguous run of graph nodes belonging to one layer instance.

    ``inputs`` are values defined outside the run and read inside it (layer inputs, parameters,
    symbolic sizes); ``outputs`` are values defined inside and read after it.
    """

    layer: str
    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]


def _layer_keys(graph: fx.Graph, prefix: str) -> list[tuple[fx.Node, str | None]]:
    """Layer of each call_function node; unlabelled nodes between two nodes of one layer join it."""
    keyed = [(n, layer_instance(n, prefix)) for n in graph.nodes if n.op == "call_function"]
    filled: list[tuple[fx.Node, str | None]] = []
    for i, (node, key) in enumerate(keyed):
        if key is None and not stack_paths(node):
            prev_key = next((k for _, k in reversed(keyed[:i]) if k is not None), None)
            next_key = next((k for _, k in keyed[i + 1:] if k is not None), None)
            if prev_key is not None and prev_key == next_key and filled and filled[-1][1] == prev_key:
                key = prev_key
        filled.append((node, key))
    return filled


def plan_segments(graph: fx.Graph, prefix: str) -> list[Segment]:
    """Split the call_function nodes of ``graph`` into per-layer segments, in graph order."""
    runs: list[tuple[str, list[fx.Node]]] = []
    for node, key in _layer_keys(graph, prefix):
        if key is None:
            continue
        if runs and runs[-1][0] == key and _only_skippable_between(runs[-1][1][-1], node):
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    segments = []
    for key, nodes in runs:
        inside = set(nodes)
        inputs: dict[fx.Node, None] = {}
        outputs: dict[fx.Node, None] = {}
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in inside:
                    inputs[arg] = None
            if any(user not in inside for user in node.users):
                outputs[node] = None
        segments.append(Segment(key, tuple(nodes), tuple(inputs), tuple(outputs)))
    return segments


def layer_names(graph: fx.Graph, prefix: str) -> list[str]:
    """Instances of the layer list ``prefix`` in the graph, in index order (``["h.0", "h.1", ...]``)."""
    raw: set[str] = set()
    for node in graph.nodes:
        path = layer_instance(node, prefix)
        if path is not None:
            raw.add(path)
    found = {clean_module_path(path) for path in raw}     # once per distinct path, not per node
    return sorted(found, key=lambda p: (int(p.rsplit(".", 1)[1]), p))


def resolve_layers(graph: fx.Graph, layers: Sequence[str]) -> tuple[str, list[str]]:
    """``(prefix, chosen)``: the main layer list and the requested instances of it, in index order.

    Raises OptionError (one line, listing the available layers) for a name that is not an instance.
    """
    prefix = find_layer_list(graph)
    if prefix is None:
        raise OptionError("--checkpoint-layers: the model has no repeated layer list (no <name>.<index> "
                          "modules in nn_module_stack)")
    available = layer_names(graph, prefix)
    wanted = {clean_module_path(str(name).strip()) for name in layers}
    unknown = sorted(wanted - set(available))
    if unknown:
        raise OptionError(f"unknown layer(s) {', '.join(unknown)} in --checkpoint-layers "
                          f"(available layers: {', '.join(available)})")
    return prefix, [name for name in available if name in wanted]


def checkpoint_segments(graph: fx.Graph, layers: Sequence[str] | None = None) -> list[Segment]:
    """Segments to run under ``checkpoint``: every instance of the main layer list (``layers`` None
    or empty), or only the named instances (``["h.0", "h.2"]``; unknown names raise OptionError)."""
    if not layers:
        prefix = find_layer_list(graph)
        if prefix is None:
            raise ValueError("checkpoint=True but no repeated layer list found in nn_module_stack")
        return plan_segments(graph, prefix)
    prefix, chosen = resolve_layers(graph, layers)
    keep = set(chosen)
    return [seg for seg in plan_segments(graph, prefix) if clean_module_path(seg.layer) in keep]


def selection_for_truncation(graph: fx.Graph, layers: Sequence[str],
                             kept: Sequence[int]) -> tuple[str, ...] | None:
    """For ``boomfx.training.truncate``: the requested layers that survive truncation to the ``kept``
    instances (plus the last), or None when the depth-free synthesis could not reproduce the choice.

    The synthesis copies one template layer to every index between 3 and N-2 and aligns instances 1,
    2 and N-1, so it is exact only when layers ``1 .. N-1`` are all checkpointed or none is (layer 0
    is free). Unknown names raise OptionError here, before any tracing.
    """
    prefix, chosen = resolve_layers(graph, layers)
    indices = {int(name.rsplit(".", 1)[1]): name for name in chosen}
    n_layers = max(int(p.rsplit(".", 1)[1]) for p in layer_names(graph, prefix)) + 1
    rest = set(indices) - {0}
    if rest and rest != set(range(1, n_layers)):
        return None
    keep = set(kept) | {n_layers - 1}
    return tuple(name for i, name in sorted(indices.items()) if i in keep)


def _only_skippable_between(a: fx.Node, b: fx.Node) -> bool:
    """True when only placeholder/get_attr nodes sit between ``a`` and ``b`` in graph order."""
    node = a.next
    while node is not b:
        if node.op not in ("placeholder", "get_attr"):
            return False
        node = node.next
    return True


# --------------------------------------------------------------------------------------------
# Running the export graph (with GPU kernel policy, device remapping and checkpointed layers)
# --------------------------------------------------------------------------------------------


# Ops whose C++ kernel reads sizes as plain ints under fake tensors (torch 2.13); any other such op
# is caught by training/trace.py's check that no size symbol was fixed. baddbmm: its meta function
# expands a broadcast ``self`` (Bloom's ALiBi bias, [batch x heads, 1, seq]) through the int-only
# ``expand`` kernel, an error without the Python dispatcher.
# im2col (F.unfold) and the real FFTs read sizes as ints too (the FFTs' C++ kernels resize their outputs
# in place, which a fake tensor refuses); nn.Bilinear's C++ composite trips an internal assert of torch's
# argument parser on fake tensors (it runs as _trilinear, as eager does).
SIZE_READING_CPP_KERNELS = {aten.pad.default, aten.constant_pad_nd.default, aten.baddbmm.default,
                            aten.im2col.default, aten.fft_rfft.default, aten.fft_irfft.default,
                            aten.bilinear.default}
# C++ composites that refuse symbolic sizes outright ("SymIntArrayRef expected to contain only concrete
# integers"): run as torch's Python decomposition of the same ops (affine_grid_generator: F.affine_grid's
# linspace, stack and matmul, as the C++ composite computes it).
DECOMPOSED_COMPOSITES = {aten.affine_grid_generator.default}


class GraphRunner:
    """Executes an export graph node by node, so every op is traced with the export node's meta.

    ``fx_traceback.set_current_meta`` makes make_fx copy ``nn_module_stack`` onto the new nodes.
    """

    def __init__(self, gm: fx.GraphModule, device: torch.device, policy: amp_policy.CastPolicy,
                 fused_attention: bool, segments: Sequence[Segment] = (),
                 on_segment: Callable[[Any], Any] | None = None):
        self.gm = gm
        self.device = device
        self.policy = policy
        self.fused_attention = fused_attention
        self.segment_at = {seg.nodes[0]: seg for seg in segments}
        self.on_segment = on_segment

    def run(self, *args: Any) -> list[Any]:
        return self._run_graph(self.gm.graph, self.gm, list(args), top=True)

    def _run_graph(self, graph: fx.Graph, owner: torch.nn.Module, args: list[Any], top: bool) -> Any:
        env: dict[fx.Node, Any] = {}
        arg_iter = iter(args)
        skip: set[fx.Node] = set()
        for node in graph.nodes:
            if node in skip:
                continue
            if node.op == "placeholder":
                env[node] = next(arg_iter)
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            elif top and node in self.segment_at:
                seg = self.segment_at[node]
                outs = self._run_checkpointed(seg, owner, [env[i] for i in seg.inputs])
                env.update(zip(seg.outputs, outs))
                skip.update(seg.nodes)
            else:
                env[node] = self._execute(node, owner, env)
        raise RuntimeError("graph has no output node")

    def _run_checkpointed(self, seg: Segment, owner: torch.nn.Module, values: list[Any]) -> Any:
        def segment_fn(*vals: Any) -> tuple[Any, ...]:
            token = self.on_segment(True) if self.on_segment else None
            try:
                local = dict(zip(seg.inputs, vals))
                for node in seg.nodes:
                    local[node] = self._execute(node, owner, local)
                return tuple(local[o] for o in seg.outputs)
            finally:
                if self.on_segment:
                    self.on_segment(token)

        return torch.utils.checkpoint.checkpoint(segment_fn, *values, use_reentrant=False)

    def _execute(self, node: fx.Node, owner: torch.nn.Module, env: dict[fx.Node, Any]) -> Any:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        with fx_traceback.set_current_meta(node):
            if node.op == "get_attr":
                return _fetch_attr(owner, str(node.target))
            if node.op != "call_function":
                raise NotImplementedError(f"{node.op} nodes are not supported: {node.format_node()}")
            target = node.target
            args, kwargs = self._remap_devices(args), self._remap_devices(kwargs)
            args, kwargs = self.policy.apply(target, args, kwargs)
            if is_inactive_dropout(node):
                # ATen returns the input itself; the Python decomposition the re-trace would use clones it
                return args[0]
            if target in RNN_OPS:     # the kernels eager runs for the layer stack (training/recurrent.py)
                return run_recurrent(target, args, kwargs, output_feeds_matmul(node))
            if target in RESIZE_OPS:  # interpolation's one kernel, its size on SymInts (training/resize.py)
                return run_resize(target, args, kwargs)
            if target in DECOMPOSED_COMPOSITES:
                return decomposition_table[target](*args, **kwargs)
            if target in SIZE_READING_CPP_KERNELS:
                # their C++ kernels read sizes as ints and would fix the batch symbol to its example
                # size (MobileNetV2/EfficientNet TF padding, Swin's window padding): run torch's
                # SymInt-aware Python meta functions and decompositions instead, as export does
                with enable_python_dispatcher():
                    return target(*args, **kwargs)
            if target is aten._assert_tensor_metadata.default and self.policy.low_dtype is not None:
                # export's check of the dtype a `.to()` saw when traced; autocast changes that dtype
                # on purpose (Mixtral's experts), and the check launches no kernel
                return None
            if target is aten.scaled_dot_product_attention.default and self.fused_attention:
                return amp_policy.gpu_sdpa(*args, **kwargs)
            if target is torch.ops.higher_order.wrap_with_set_grad_enabled:
                with torch.set_grad_enabled(args[0]):
                    return self._run_graph(args[1].graph, args[1], list(args[2:]), top=False)
            if target is torch.ops.higher_order.wrap_with_autocast:
                # A region the model itself wraps in autocast: enabled=False (common around
                # rotary embeddings) switches our policy off inside it.
                _device_type, dtype, enabled, _cache = args[:4]
                outer = self.policy
                self.policy = amp_policy.CastPolicy((dtype or outer.low_dtype) if enabled else None)
                try:
                    return self._run_graph(args[4].graph, args[4], list(args[5:]), top=False)
                finally:
                    self.policy = outer
            return target(*args, **kwargs)

    def _remap_devices(self, tree: Any) -> Any:
        """Devices baked into the export (``meta``, ``cuda``) become the fake tensors' device."""
        return torch.utils._pytree.tree_map_only(torch.device, lambda _: self.device, tree)


def _fetch_attr(owner: torch.nn.Module, target: str) -> Any:
    obj: Any = owner
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
