"""Channels-last convolutions under ``torch.compile``: whether Inductor runs a graph's 2-D convolutions
channels-last, and the conversion copies that costs.

Inductor decides once per graph (``GraphLowering.decide_layout_opt`` in torch/_inductor/graph.py, torch
2.13). When it does, every 2-D convolution (forward and ``convolution_backward``) requires channels-last
operands (kernel/conv.py ``require_channels_last``). Activations computed inside the graph are simply
produced channels-last (free), but a graph *input* in the default contiguous layout (the weights, the
image) is copied into a channels-last buffer before its first convolution, on every call. In training
the copy is a saved tensor: it stays live from the forward to its use in ``convolution_backward``
(measured on a ResNet with the C++ backend: every 3x3/7x7 weight and the input image are copied at the
start of the forward and returned as saved tensors; 1x1 weights are already channels-last and are
reinterpreted, not copied).

``channels_last_convolutions(program, backend)`` inserts those copies
(``aten.clone(x, memory_format=torch.channels_last)``) so liveness, the allocator replay and the cost
model see them, then recomputes the values downstream on fake tensors so every convolution, norm and
pointwise op after them carries Inductor's channels-last strides (the kernel database keys and measures
what the compiled run executes), and copies each channels-last weight gradient back into the
parameter's layout before the optimizer (AccumulateGrad). Inductor's backward graph runs without layout
optimisation, and hands depthwise ``convolution_backward`` calls an input copied into (N, H, C, W) order
and a contiguous gradient (``backward_convolution_operands``, after the partitioner). Not modelled: the dynamic-shape opt-out of the
GPU heuristic (a compiled run specialises its first shapes); the layout of a convolution operand computed
in the graph from a graph input (an AMP cast of a weight: Inductor writes it channels-last at no extra
cost, we keep its traced layout and price that convolution contiguous).
"""
from __future__ import annotations

import contextlib
from typing import Any

import sympy
import torch
import torch.fx

from boomfx.passes.fusion import CLASS_POINTWISE, node_class
from boomfx.passes.specs import to_sympy
from boomfx.core.program import META_EAGER, PHASE_FORWARD, PHASE_OPTIMIZER, Program

_aten = torch.ops.aten
_FORWARD_CONVS = (_aten.convolution.default, _aten.conv2d.default)
# operand positions Inductor makes channels-last: (input, weight) of a convolution, (input, weight) of
# its backward (grad_output is computed in the graph)
_OPERANDS = {_aten.convolution.default: (0, 1), _aten.conv2d.default: (0, 1),
             _aten.convolution_backward.default: (1, 2)}

# GraphLowering.decide_layout_opt: average channels-last time ratio per convolution kind (inference)
_GROUPED, _DEFAULT, _IN_OUT, _SMALL = 1.358, 0.823, 0.725, 0.783
_NODES_PER_CONV_LIMIT = 300
_NHCW = (0, 2, 1, 3)     # (N, H, C, W): the order Inductor's backward gives a depthwise convolution's input


def _weight(node: torch.fx.Node) -> Any:
    return node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None


def _groups(node: torch.fx.Node) -> int:
    if node.target is _aten.conv2d.default:
        return int(node.args[6]) if len(node.args) > 6 else int(node.kwargs.get("groups", 1))
    return int(node.args[-1])


def _conv2d_nodes(program: Program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target in _FORWARD_CONVS
            and isinstance(_weight(n), torch.Tensor) and _weight(n).dim() == 4]


def size_hint(value: Any, program: Program) -> float:
    """A number for a (possibly symbolic) size: each symbol's example value, else its lower bound (at
    least 2): the sizes a compiled run specialises on."""
    expr = sympy.sympify(to_sympy(value))
    subs = {}
    for sym in expr.free_symbols:
        info = program.symbols.get(str(sym))
        subs[sym] = (info.hint if info is not None and info.hint is not None
                     else max(info.min_value if info is not None else 2, 2))
    return float(expr.subs(subs))


def _flops(node: torch.fx.Node, program: Program) -> float:
    out, w = node.meta["val"], _weight(node)
    per_output = 2 * w.shape[1] * w.shape[2] * w.shape[3]
    return size_hint(out.numel() * per_output, program)


def uses_channels_last(program: Program, backend: str) -> bool:
    """Inductor's layout decision for ``program`` (``decide_layout_opt``; see module docstring)."""
    convs = _conv2d_nodes(program)
    if not convs:
        return False
    if backend == "cpu":
        return True          # "For cpu backend and mkldnn enabled, we always use channels_last"
    forward = [n for n in program.graph.nodes if program.phase_of(n) == PHASE_FORWARD]
    if len(forward) >= _NODES_PER_CONV_LIMIT * len(convs):
        return False

    def grouped(n: torch.fx.Node) -> bool:
        return _groups(n) > 1 and _weight(n).shape[1] > 1

    def in_out(n: torch.fx.Node) -> bool:
        w = _weight(n)
        return (size_hint(w.shape[0] * 2, program) <= size_hint(w.shape[1], program)
                and size_hint(w.shape[2], program) > 1)

    def small(n: torch.fx.Node) -> bool:
        w = _weight(n)
        return size_hint(w.shape[0], program) <= 64 and size_hint(w.shape[1], program) <= 64

    if not program.options.train:
        total = weighted = 0.0
        for n in convs:
            flops = _flops(n, program)
            ratio = _GROUPED if grouped(n) else _SMALL if small(n) else _IN_OUT if in_out(n) else _DEFAULT
            total += flops
            weighted += flops * ratio
        return weighted <= total
    if any(map(grouped, convs)) or any(map(in_out, convs)):
        return False
    return not all(map(small, convs))


def _is_contiguous(val: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
    try:
        return bool(val.is_contiguous(memory_format=memory_format))
    except RuntimeError:      # a symbolic stride Inductor would guard on: treat as not in that layout
        return False


def channels_last_convolutions(program: Program, backend: str) -> Program:
    """``program`` with a channels-last copy of each graph input a 2-D convolution reads, when Inductor
    would run its convolutions channels-last; unchanged otherwise."""
    if not uses_channels_last(program, backend):
        return program
    graph, _ = program.copied_graph()
    phases = dict(program.phases)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        positions = _OPERANDS.get(node.target) if node.op == "call_function" else None
        if positions is None:
            continue
        weight = node.args[positions[1]]
        if not (isinstance(weight, torch.fx.Node) and isinstance(weight.meta.get("val"), torch.Tensor)
                and weight.meta["val"].dim() == 4):
            continue
        args = list(node.args)
        for i in positions:
            src = args[i]
            if not (isinstance(src, torch.fx.Node) and src.op == "placeholder"
                    and isinstance(src.meta.get("val"), torch.Tensor)
                    and not _is_contiguous(src.meta["val"], torch.channels_last)):
                continue
            if src not in copies:
                with graph.inserting_before(node):
                    copies[src] = _copy(graph, src, torch.channels_last, node, phases)
            args[i] = copies[src]
        node.args = tuple(args)
    if not copies:
        return program
    grad_nodes = dict(program.grad_nodes)
    if _propagate_layouts(graph, set(copies.values()), phases):
        grad_nodes = _contiguous_gradients(graph, phases, grad_nodes)
    return program.rewritten(graph, phases=phases, grad_nodes=grad_nodes)


def _copy(graph: torch.fx.Graph, src: torch.fx.Node, memory_format: torch.memory_format,
          site: torch.fx.Node, phases: dict[str, str]) -> torch.fx.Node:
    """A ``clone(src, memory_format=...)`` node at the graph's insertion point, with its fake value, the
    module stack of ``site`` (the node it serves) and the phase of ``site``."""
    copy = graph.call_function(_aten.clone.default, (src,), {"memory_format": memory_format})
    copy.meta = {k: v for k, v in site.meta.items() if k in ("nn_module_stack", "stack_trace")}
    with _fake_mode(graph):
        copy.meta["val"] = src.meta["val"].clone(memory_format=memory_format)
    phases[copy.name] = phases.get(site.name, PHASE_FORWARD)
    return copy


def backward_convolution_operands(program: Program, backend: str) -> Program:
    """``program`` (partitioned: forward, recomputation and backward as Inductor's two graphs hold them)
    with the operand copies Inductor's backward graph makes for depthwise ``convolution_backward`` calls
    (``_inductor_backward_operands``) when its forward ran channels-last; unchanged otherwise. Runs after
    the partitioner, as Inductor's lowering does: the copies are not in the joint graph it cuts, so they
    must not turn a saved activation into a recomputed one."""
    if not program.options.train or not uses_channels_last(program, backend):
        return program
    graph, _ = program.copied_graph()
    phases = dict(program.phases)
    changed = _inductor_backward_operands(graph, phases)
    if not changed or not _propagate_layouts(graph, changed, phases):
        return program
    return program.rewritten(graph, phases=phases, grad_nodes=_drop_needless_gradient_copies(graph, program.grad_nodes))


def _drop_needless_gradient_copies(graph: torch.fx.Graph, grad_nodes: dict[str, str]) -> dict[str, str]:
    """Remove ``_contiguous_gradients``' copy of a weight gradient that now comes out contiguous."""
    by_name = {n.name: n for n in graph.nodes}
    out: dict[str, str] = {}
    for name, fqn in grad_nodes.items():
        node = by_name.get(name)
        src = node.args[0] if node is not None and node.meta.get(META_EAGER) and node.args else None
        if (node is not None and node.target is _aten.clone.default and isinstance(src, torch.fx.Node)
                and isinstance(src.meta.get("val"), torch.Tensor) and _is_contiguous(src.meta["val"])):
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            out[src.name] = fqn
        else:
            out[name] = fqn
    return out


def _in_order(val: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``val`` is dense in the dimension order ``order`` (outermost first)."""
    try:
        return bool(val.permute(*order).is_contiguous())
    except RuntimeError:      # a symbolic stride: not provably in that order
        return False


def _copy_in_order(graph: torch.fx.Graph, src: torch.fx.Node, order: tuple[int, ...],
                   site: torch.fx.Node, phases: dict[str, str]) -> torch.fx.Node:
    """A dense copy of ``src`` with its dimensions laid out in ``order`` (a self-inverse permutation):
    permute (a view), a contiguous clone (the one buffer), permute back."""
    with graph.inserting_before(site):
        view = graph.call_function(_aten.permute.default, (src, list(order)))
        with _fake_mode(graph):
            view.meta["val"] = src.meta["val"].permute(*order)
        phases[view.name] = phases.get(site.name, PHASE_FORWARD)
        dense = _copy(graph, view, torch.contiguous_format, site, phases)
        back = graph.call_function(_aten.permute.default, (dense, list(order)))
        with _fake_mode(graph):
            back.meta["val"] = dense.meta["val"].permute(*order)
        phases[back.name] = phases.get(site.name, PHASE_FORWARD)
    return back


def _inductor_backward_operands(graph: torch.fx.Graph, phases: dict[str, str]) -> set[torch.fx.Node]:
    """The operands Inductor's backward graph hands a ``convolution_backward``, depthwise ones above all.

    The backward graph holds no forward convolution, so ``decide_layout_opt`` turns layout optimisation
    off there, and ``convolution_backward_lowering`` (torch/_inductor/kernel/conv.py) requires the input
    and the incoming gradient in the stride order of the weight gradient's fake layout. A depthwise
    weight gradient (in-channels 1) of channels-last operands is ``(k*k, 1, k, 1)``: C and W tie, and
    the order Inductor derives is (N, H, C, W), into which the saved channels-last input is copied; the
    input-gradient half then requires the incoming gradient contiguous (its producer writes it so). An
    (N, H, C, W) input suggests no channels-last, so oneDNN runs the call contiguous: it copies the input
    once more and takes the contiguous path's scratch (kernels_db/cpu_scratch.py), and the weight
    gradient comes out contiguous (no copy before the optimizer). Read in the output code of compiled
    ConvNeXt and MobileNetV2 training steps (torch 2.13, CPU): every depthwise backward gets an
    (N, H, C, W) input and a contiguous gradient. A dense backward of a channels-last input has no tie:
    its incoming gradient is required channels-last, and a kernel computing it in the graph simply
    writes it so (its value is given channels-last strides here, no copy; an extern's output or a graph
    input would be copied, left as it is). Under a wide 3x3 head, the mean's backward wrote the head's
    gradient contiguous here and the call was priced with a 2 MiB copy: +39% at the peak, -0.0% now.
    Returns the nodes inserted or re-laid (empty if none)."""
    inserted: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.convolution_backward.default:
            continue
        grad_out, inp, weight = node.args[0], node.args[1], node.args[2]
        w = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
        mask = node.args[10] if len(node.args) > 10 else [True, True, True]
        if not (isinstance(w, torch.Tensor) and w.dim() == 4 and isinstance(inp, torch.fx.Node)
                and isinstance(grad_out, torch.fx.Node)):
            continue
        args = list(node.args)
        if int(w.shape[1]) > 1:
            # a dense weight gradient's layout follows its channels-last input (no tie): the incoming
            # gradient is required channels-last, which the kernel computing it simply writes
            g = grad_out.meta.get("val")
            if (_is_contiguous(inp.meta["val"], torch.channels_last) and isinstance(g, torch.Tensor)
                    and not _is_contiguous(g, torch.channels_last) and node_class(grad_out) == CLASS_POINTWISE
                    and phases.get(grad_out.name) != PHASE_FORWARD):
                with _fake_mode(graph):
                    grad_out.meta["val"] = g.contiguous(memory_format=torch.channels_last)
                inserted.add(grad_out)
            continue
        if not (int(node.args[9]) > 1 and mask[1]):
            continue
        if not _in_order(inp.meta["val"], _NHCW):
            args[1] = _copy_in_order(graph, inp, _NHCW, node, phases)
            inserted.add(args[1])
        if mask[0] and not _is_contiguous(grad_out.meta["val"]):
            with graph.inserting_before(node):
                args[0] = _copy(graph, grad_out, torch.contiguous_format, node, phases)
            inserted.add(args[0])
        elif not mask[0] and not _in_order(grad_out.meta["val"], _NHCW):
            args[0] = _copy_in_order(graph, grad_out, _NHCW, node, phases)
            inserted.add(args[0])
        node.args = tuple(args)
    return inserted


def _fake_mode(graph: torch.fx.Graph) -> Any:
    for node in graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return contextlib.nullcontext()


def _propagate_layouts(graph: torch.fx.Graph, sources: set[torch.fx.Node], phases: dict[str, str]) -> bool:
    """Recompute the value (shape, strides) of every node downstream of the channels-last copies, as
    Inductor's layouts follow them: convolutions of channels-last operands are channels-last, and so
    are the pointwise ops, norms and convolution backwards reading them. The kernel database then keys
    (and measures) the convolutions the compiled run executes (eager ResNet inference on the dev CPU:
    5.4 ms channels-last vs 7.2 ms contiguous). The optimizer step is left alone: AccumulateGrad hands it
    gradients in the parameters' layout (``_contiguous_gradients``). If any op fails on the new
    layouts, every value is restored and False returned (the copies stay)."""
    mode = _fake_mode(graph)
    changed = set(sources)
    saved: dict[torch.fx.Node, Any] = {}
    for node in graph.nodes:
        if (node.op != "call_function" or node in sources or phases.get(node.name) == PHASE_OPTIMIZER
                or not any(i in changed for i in node.all_input_nodes)):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        try:
            with mode:
                val = node.target(*args, **kwargs)
        except Exception:           # noqa: BLE001 - any op without a rule for these layouts: keep the trace's
            for n, old in saved.items():
                n.meta["val"] = old
            return False
        saved[node] = node.meta.get("val")
        node.meta["val"] = val
        changed.add(node)
    return True


def _contiguous_gradients(graph: torch.fx.Graph, phases: dict[str, str], grad_nodes: dict[str, str]) -> dict[str, str]:
    """A weight gradient that came out channels-last is copied into the parameter's (contiguous) layout
    before the optimizer reads it: AccumulateGrad's ``clone_obey_contract`` (torch/csrc/autograd/
    functions/accumulate_grad.h) when ``.grad`` is None. The copy is the gradient the step holds; the
    engine makes it eagerly, after the compiled backward returned (``META_EAGER``: one aten copy, never
    fused; on the dev CPU 9 ResNet weight copies took 1.5 ms in a 29 ms compiled step)."""
    by_name = {n.name: n for n in graph.nodes}
    out: dict[str, str] = {}
    for name, fqn in grad_nodes.items():
        node = by_name.get(name)
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor) or val.dim() != 4 or _is_contiguous(val):
            out[name] = fqn
            continue
        with graph.inserting_after(node):
            copy = _copy(graph, node, torch.contiguous_format, node, phases)
        copy.meta[META_EAGER] = True
        for user in list(node.users):
            if user is not copy and (user.op == "output" or phases.get(user.name) == PHASE_OPTIMIZER):
                user.replace_input_with(node, copy)
        out[copy.name] = fqn
    return out

