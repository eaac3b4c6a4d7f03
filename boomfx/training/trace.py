"""Build training-step and inference graphs from an inference export, on fake tensors.

Why: users export a model for inference (often built on the meta device), but want the time and
memory of a *training* step. We re-run the export graph under ``make_fx`` on fake tensors that
carry the export's own size symbols (``s0``, ``s1``), reduce the output to a loss, differentiate with
``torch.autograd.grad`` and trace a ``torch.optim`` step (foreach, as eager CUDA defaults to, or the
per-parameter loop eager CPU defaults to: ``foreach=False``). No real memory is allocated. GPU
dispatch decisions (CUDA autocast lists, fused attention kernels) come from :mod:`boomfx.training.amp`,
since the fake tensors live on CPU (see ``_FAKE_DEVICE``).

Example::

    ep = torch.export.export(model, (ids,), dynamic_shapes=...)
    prog = build_training_program(ep, optimizer="adamw", amp="bf16", checkpoint=True)
    prog = build_training_program(ep, checkpoint_layers=["h.0", "h.2"])   # only those layers
    prog = build_training_program(ep, resident_grads=True)   # zero_grad(set_to_none=False): .grad kept
    prog.phases["mm_3"]          # "forward" | "backward" | "optimizer" | "recompute"
    prog.grad_nodes["mm_40"]     # "h.0.attn.qkv.weight"

Known limitations:
    - Buffer mutations recorded by the export (e.g. BatchNorm running stats) are not replayed.
    - Optimizer state is steady state (already allocated); the first step's allocation is not shown.
    - fp16 training models GradScaler's unscale/update kernels but assumes no inf/NaN step skip.
    - Higher-order ops other than the export's grad-mode/autocast wrappers are called as-is.
    - Unbacked symbols (from ``.item()`` of the optimizer's step counter) are not size symbols and
      are left out of ``symbol_map``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks_from_tensors
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode

from boomfx.training import amp as amp_policy
from boomfx.training.checkpointing import SIZE_READING_CPP_KERNELS, GraphRunner, Segment, checkpoint_segments
from boomfx.core.program import (
    META_NATIVE_LOOP, PHASE_BACKWARD, PHASE_FORWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE, ROLE_BUFFER, ROLE_CONSTANT, ROLE_GRAD,
    ROLE_INPUT, ROLE_LABEL, ROLE_OPT_STATE, ROLE_PARAM,
)
from boomfx.core.errors import UnsupportedError
from boomfx.training.fake_kernels import fake_kernel_fixes


ROLES = (ROLE_PARAM, ROLE_BUFFER, ROLE_GRAD, ROLE_OPT_STATE, ROLE_INPUT, ROLE_LABEL, ROLE_CONSTANT)
PHASES = (PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER, PHASE_RECOMPUTE)
META_PHASE = "boomfx.phase"

_KIND_ROLE = {
    InputKind.PARAMETER: ROLE_PARAM,
    InputKind.BUFFER: ROLE_BUFFER,
    InputKind.CONSTANT_TENSOR: ROLE_CONSTANT,
    InputKind.USER_INPUT: ROLE_INPUT,
}
# Fake tensors live on CPU: autograd on fake CUDA tensors aborts in CPU-only builds (no CUDA device
# guard). GPU behaviour comes from boomfx.training.amp's explicit policies instead.
_FAKE_DEVICE = torch.device("cpu")
NO_OPTIMIZER = "none"     # --optimizer none: forward and backward only
_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ("momentum_buffer",)),
    "adam": (torch.optim.Adam, ("exp_avg", "exp_avg_sq")),
    "adamw": (torch.optim.AdamW, ("exp_avg", "exp_avg_sq")),
}


@dataclass(frozen=True)
class TracedProgram:
    """A traced step: graph, role of each input and phase of each op.

    ``grad_nodes`` maps the node producing each parameter's gradient to the parameter's FQN; the
    gradient lives from that node until its last use in the optimizer phase.
    """

    gm: fx.GraphModule
    input_roles: dict[str, str]
    phases: dict[str, str]
    symbol_map: dict[sympy.Symbol, sympy.Symbol]
    param_names: dict[str, str]
    grad_nodes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Input:
    name: str
    role: str
    fqn: str | None
    value: Any  # FakeTensor (or SymInt / python scalar) from the export


# --------------------------------------------------------------------------------------------
# Fake inputs carrying the export's symbols
# --------------------------------------------------------------------------------------------


def _export_inputs(ep: ExportedProgram) -> list[_Input]:
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    inputs = []
    for spec, node in zip(ep.graph_signature.input_specs, placeholders):
        role = _KIND_ROLE.get(spec.kind)
        if role is None:
            raise NotImplementedError(f"input kind {spec.kind} of {node.name} is not supported")
        inputs.append(_Input(node.name, role, spec.target, node.meta.get("val")))
    return inputs


def _tied_expansion(ep: ExportedProgram, inputs: list[_Input]) -> list[int]:
    """For each export input, the position of the first input sharing its storage (itself if none)."""
    first_of: dict[str, int] = {}
    for group in tied_parameters(ep):
        positions = [pos for pos, i in enumerate(inputs) if i.fqn in group]
        first_of.update({inputs[pos].fqn: positions[0] for pos in positions if positions})  # type: ignore[misc]
    return [first_of.get(i.fqn, pos) if i.fqn is not None else pos for pos, i in enumerate(inputs)]


def tied_parameters(ep: ExportedProgram) -> list[list[str]]:
    """Groups of parameter FQNs that share one storage (e.g. GPT-2's lm_head.weight = wte.weight).

    NB: only visible when the program holds the weights (in memory, or a .pt2 written with real weights);
    a meta-device export records each name separately, so ties there cannot be seen."""
    groups: dict[int, list[str]] = {}
    for name, tensor in ep.state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            groups.setdefault(tensor.untyped_storage()._cdata, []).append(name)
        elif isinstance(tensor, torch.Tensor):
            groups.setdefault(id(tensor), []).append(name)   # the same meta Parameter object under two names
    return [sorted(g) for g in groups.values() if len(g) > 1]


def _symbols_of(value: Any) -> set[sympy.Symbol]:
    exprs: list[Any] = []
    if isinstance(value, torch.Tensor):
        exprs = [*value.shape, *value.stride(), value.storage_offset()]
    elif isinstance(value, torch.SymInt):
        exprs = [value]
    out: set[sympy.Symbol] = set()
    for e in exprs:
        if isinstance(e, torch.SymInt):
            out |= e.node.expr.free_symbols
    return out


def _choose_hints(ep: ExportedProgram, symbols: set[sympy.Symbol]) -> dict[sympy.Symbol, int]:
    """Distinct example sizes >= 2 inside each symbol's range, so no dim is specialised to 0/1 and
    no two dims compare equal by accident (which would add ``Eq`` guards and merge them)."""
    hints: dict[sympy.Symbol, int] = {}
    used: set[int] = set()
    candidates = iter(range(17, 1 << 20, 2))  # odd, so hints are rarely divisible by static sizes
    for sym in sorted(symbols, key=str):
        vr = ep.range_constraints.get(sym)
        lo = max(int(vr.lower), 2) if vr is not None and vr.lower.is_Integer else 2
        hi = int(vr.upper) if vr is not None and vr.upper.is_Integer else 1 << 30
        hint = next((c for c in candidates if lo <= c <= hi and c not in used), None)
        if hint is None:
            hint = next((c for c in range(lo, hi + 1) if c not in used), lo)
        candidates = iter(range(hint + 2, 1 << 20, 2))
        hints[sym] = hint
        used.add(hint)
    return hints


class _FakeFactory:
    """Recreates export values as fake tensors in a fresh ShapeEnv that reuses the export's symbols."""

    def __init__(self, ep: ExportedProgram, symbols: set[sympy.Symbol]) -> None:
        self.shape_env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=False)
        self.hints = _choose_hints(ep, symbols)
        for sym, hint in self.hints.items():
            self.shape_env.add_backed_var_to_val(sym, hint)
            vr = ep.range_constraints.get(sym)
            if vr is not None:
                self.shape_env.constrain_symbol_range(sym, compiler_min=vr.lower, compiler_max=vr.upper)

    def sym(self, value: Any) -> Any:
        if not isinstance(value, torch.SymInt):
            return value
        expr = value.node.expr
        return self.shape_env.create_symintnode(expr, hint=int(expr.xreplace(self.hints)))

    def tensor(self, like: torch.Tensor, device: torch.device, requires_grad: bool = False,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        size = [self.sym(s) for s in like.shape]
        stride = [self.sym(s) for s in like.stride()]
        with self.mode:
            t = torch.empty_strided(size, stride, dtype=dtype or like.dtype, device=device)
        return t.requires_grad_(requires_grad)


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------


class _PhaseRecorder:
    """Remembers which traced nodes each phase created, by watching the make_fx graph grow."""

    def __init__(self) -> None:
        self.phase = PHASE_FORWARD
        self.by_name: dict[str, str] = {}
        self._seen = 0

    def _graph(self) -> fx.Graph:
        mode = get_proxy_mode()
        assert mode is not None, "phase recording only works inside make_fx"
        return mode.tracer.graph

    def close(self, phase: str) -> None:
        """Tag every node created since the last call with ``phase``."""
        nodes = list(self._graph().nodes)
        for node in nodes[self._seen:]:
            if node.op == "call_function":
                self.by_name[node.name] = phase
        self._seen = len(nodes)

    def segment(self, token: Any) -> Any:
        """Checkpoint hook: a segment run while in backward is a recomputation."""
        if token is True:  # entering a segment
            if self.phase == PHASE_BACKWARD:
                self.close(PHASE_BACKWARD)
                return PHASE_RECOMPUTE
            return None
        if token == PHASE_RECOMPUTE:
            self.close(PHASE_RECOMPUTE)
        return None


def _compute_dtype(param_dtype: str | None) -> torch.dtype | None:
    """``"bfloat16"``/``"float16"`` -> the dtype parameters compute in; None or fp32: as exported."""
    if param_dtype is None:
        return None
    dtype = getattr(torch, param_dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"param_dtype must be a floating torch dtype name, got {param_dtype!r}")
    return None if dtype == torch.float32 else dtype


def resolved_loss(ep: Any, loss: str) -> str:
    """What ``loss`` is for the export ``ep``: ``"output"`` (its scalar first output), ``"cross_entropy"``
    (against its ``labels`` input, or new next-token labels) or ``"mean"``; the real step of
    ``boomfx validate`` computes the same one."""
    if loss != "auto":
        return loss
    specs = ep.graph_signature.output_specs
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    first = next((a.meta.get("val") for a, s in zip(out_node.args[0], specs)
                  if s.kind == OutputKind.USER_OUTPUT and isinstance(a, fx.Node)), None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return "output"
    takes_labels = any(s.kind == InputKind.USER_INPUT and getattr(s.arg, "name", None) == "labels"
                       for s in ep.graph_signature.input_specs)
    return "cross_entropy" if takes_labels or token_logits(ep, first) else "mean"


def token_logits(ep: Any, output: Any) -> bool:
    """Whether ``output`` holds a language model's logits: floating, its last dimension the row count of
    an embedding table looked up with integer ids (the vocabulary). ``loss="auto"`` trains those with
    cross-entropy against next-token labels, as every LM training loop does; a mean of the logits would
    miss the fp32 log-probabilities cross-entropy keeps for backward ([tokens, vocab], the largest
    tensor of many LM steps)."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.dim() < 2:
        return False
    vocab = output.shape[-1]
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.embedding.default:
            continue
        weight, ids = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in n.args[:2])
        if (isinstance(weight, torch.Tensor) and isinstance(ids, torch.Tensor) and not ids.is_floating_point()
                and weight.dim() == 2 and weight.shape[0] == vocab):
            return True
    return False


def _loss_of(outputs: list[Any], labels: torch.Tensor | None, loss: str, upcast: bool = False,
             cross_entropy: Any = None) -> torch.Tensor:
    """The step's loss. ``upcast``: low-precision logits go to fp32 for cross-entropy first, as
    transformers' ``ForCausalLMLoss`` and torchtitan's loss do (and autocast would: log_softmax and
    nll_loss are on its fp32 lists; the loss runs outside the export graph's cast policy). ``cross_entropy``: the export's own
    (a rewrite's: loss parallelism on vocabulary-split logits) in place of ``F.cross_entropy``."""
    first = next(o for o in outputs if isinstance(o, torch.Tensor) and o.is_floating_point())
    if loss == "output" or (loss == "auto" and first.dim() == 0):
        return first
    if loss == "cross_entropy" or (loss == "auto" and labels is not None):
        assert labels is not None
        logits = first.float() if upcast else first
        return (cross_entropy or F.cross_entropy)(logits.flatten(0, -2), labels.flatten())
    return first.mean()


def _trace(ep: ExportedProgram, *, train: bool, optimizer: str, optimizer_kwargs: dict[str, Any],
           amp: str | None, checkpoint: bool, loss: str, fused_attention: bool,
           checkpoint_layers: Sequence[str] = (), resident_grads: bool = False,
           param_dtype: str | None = None) -> TracedProgram:
    low_dtype = amp_policy.parse_amp(amp)
    compute_dtype = _compute_dtype(param_dtype)
    if compute_dtype is not None and low_dtype is not None:
        raise ValueError("param_dtype (FSDP mixed precision) and amp (autocast) are two ways of the same thing; "
                         "give one")
    device = _FAKE_DEVICE
    inputs = _export_inputs(ep)
    user_outputs = [i for i, s in enumerate(ep.graph_signature.output_specs)
                    if s.kind == OutputKind.USER_OUTPUT]
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    out_vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in out_node.args[0]]
    symbols = set().union(*(_symbols_of(i.value) for i in inputs), *(_symbols_of(v) for v in out_vals))
    symbols |= {s for s in ep.range_constraints if isinstance(s, sympy.Symbol)}
    fake = _FakeFactory(ep, symbols)

    def make(i: _Input) -> Any:
        if isinstance(i.value, torch.Tensor):
            grad = train and i.role == ROLE_PARAM
            # param_dtype: the parameters the step computes with (FSDP's unsharded parameters)
            low = compute_dtype if i.role == ROLE_PARAM and i.value.is_floating_point() else None
            return fake.tensor(i.value, device, requires_grad=grad, dtype=low)
        return fake.sym(i.value)

    # Tied weights (GPT-2's lm_head = wte) are one placeholder per name in the export but one tensor in
    # eager: trace them as one leaf, so they get one gradient and one optimizer state.
    expand = _tied_expansion(ep, inputs)
    kept = sorted(set(expand))
    unique = [inputs[k] for k in kept]
    position = {k: i for i, k in enumerate(kept)}
    expand = [position[k] for k in expand]
    graph_args = [make(i) for i in unique]
    names = [i.name for i in unique]
    roles = [i.role for i in unique]
    fqns = [i.fqn for i in unique]
    user_input_names = {i.name for i in unique if i.role == ROLE_INPUT}

    # Labels: an export input named "labels" (HF models compute the loss themselves), else a new one.
    n_labels = 0
    if train:
        for pos, i in enumerate(unique):
            if i.name == "labels":
                roles[pos] = ROLE_LABEL
        first_out = out_vals[user_outputs[0]] if user_outputs else None
        wants_ce = resolved_loss(ep, loss) == "cross_entropy"
        if wants_ce and "labels" not in user_input_names:
            assert isinstance(first_out, torch.Tensor)
            with fake.mode:
                lbl = torch.empty([fake.sym(s) for s in first_out.shape[:-1]], dtype=torch.long, device=device)
            graph_args.append(lbl)
            names.append("labels")
            roles.append(ROLE_LABEL)
            fqns.append(None)
            n_labels = 1
        if wants_ce:
            loss = "cross_entropy"

    # Optimizer state (steady state: already allocated, passed in).
    param_pos = [p for p, r in enumerate(roles) if r == ROLE_PARAM]
    # --resident-grads: each parameter's .grad buffer, allocated before the step (zero_grad(set_to_none=False))
    grad_args = _grad_buffers(fake, graph_args, names, roles, fqns, param_pos, device) if resident_grads else []
    # optimizer "none": forward + backward only (a gradient-accumulation micro-batch); the gradients are
    # outputs of the step, held by .grad to its end as in eager
    opt_cls, state_keys = _OPTIMIZERS[optimizer] if train and optimizer != NO_OPTIMIZER else (None, ())
    opt_kwargs = {"foreach": True, **optimizer_kwargs}
    if optimizer == "sgd" and opt_kwargs.get("momentum", 0) == 0:
        state_keys = ()
    with_step = train and optimizer in ("adam", "adamw")
    opt_args: list[Any] = []
    for key in state_keys:
        for p in param_pos:
            opt_args.append(fake.tensor(graph_args[p], device))
            names.append(f"{key}_{names[p]}")
            roles.append(ROLE_OPT_STATE)
            fqns.append(fqns[p])
    if with_step:
        for p in param_pos:  # eager keeps `step` as a CPU scalar unless capturable/fused
            with fake.mode:
                opt_args.append(torch.zeros((), dtype=torch.float32, device="cpu"))
            names.append(f"step_{names[p]}")
            roles.append(ROLE_OPT_STATE)
            fqns.append(fqns[p])
    scaler = train and low_dtype == torch.float16
    if scaler:
        with fake.mode:
            opt_args += [torch.empty((), device=device), torch.empty((1,), dtype=torch.int32, device=device)]
        names += ["grad_scale", "growth_tracker"]
        roles += [ROLE_OPT_STATE, ROLE_OPT_STATE]
        fqns += [None, None]

    segments: list[Segment] = []
    if (checkpoint or checkpoint_layers) and train:
        # every instance of the layer list, or only the named ones (selective checkpointing)
        segments = checkpoint_segments(ep.graph, checkpoint_layers)

    recorder = _PhaseRecorder()
    policy: Any = (amp_policy.ComputeDtypePolicy(compute_dtype) if compute_dtype is not None
                   else amp_policy.CastPolicy(low_dtype))
    runner = GraphRunner(ep.graph_module, device, policy, fused_attention, segments, recorder.segment)
    n_graph = len(unique)
    grad_names: list[str | None] = []

    def step(*flat: Any) -> Any:
        g_args = list(flat[:n_graph])
        labels = flat[n_graph] if n_labels else None
        with torch.set_grad_enabled(train):
            outs = runner.run(*(g_args[k] for k in expand))
        outs = [outs[i] for i in user_outputs]
        if not train:
            recorder.close(PHASE_FORWARD)
            return outs
        if labels is None and "labels" in names[:n_graph]:
            labels = g_args[names.index("labels")]
        loss_val = _loss_of(outs, labels, loss, upcast=compute_dtype is not None or low_dtype is not None,
                            cross_entropy=getattr(ep, "cross_entropy", None))
        policy.clear_cache()  # the forward autocast region ends here
        grad_bufs = list(flat[n_graph + n_labels: n_graph + n_labels + len(grad_args)])
        opt_state = list(flat[n_graph + n_labels + len(grad_args):])
        if scaler:
            scale, growth = opt_state[-2:]
            loss_val = loss_val * scale
        recorder.close(PHASE_FORWARD)
        recorder.phase = PHASE_BACKWARD
        params = [g_args[p] for p in param_pos]
        # Hooks that give each backward node its forward node's seq_nr (then nn_module_stack).
        setup_stacktrace_preservation_hooks_from_tensors(loss_val)
        tracer = get_proxy_mode().tracer  # type: ignore[union-attr]
        if resident_grads:
            grads = _accumulate_into(loss_val, params, grad_bufs)
            grad_names.extend(_accumulated_grad(b, tracer) for b in grads)
        else:
            grads = torch.autograd.grad(loss_val, params, materialize_grads=True)
            grad_names.extend(get_proxy_slot(g, tracer).proxy.node.name for g in grads)
        recorder.close(PHASE_BACKWARD)
        if opt_cls is None:
            return (loss_val.detach(), *([] if resident_grads else grads))
        recorder.phase = PHASE_OPTIMIZER
        with torch.no_grad():
            if scaler:
                found_inf = torch.zeros((1,), device=device)
                inv_scale = scale.double().reciprocal().float()
                torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)
            opt = _optimizer_step(opt_cls, opt_kwargs, state_keys, with_step, params, grads, opt_state)
            if scaler:
                torch._amp_update_scale_(scale, growth, found_inf, 2.0, 0.5, 2000)
            if resident_grads:   # the buffers stay allocated; the next step accumulates into zeros
                opt.zero_grad(set_to_none=False)
        recorder.close(PHASE_OPTIMIZER)
        return loss_val.detach()

    # A graph with ops whose C++ kernels read sizes as ints (pad: MobileNetV2, EfficientNet, Swin) is
    # traced under the Python dispatcher, forward and backward (torch's SymInt-aware Python meta functions
    # and decompositions, as export does); others as before. _check_no_specialisation refuses any other
    # op that fixed a size symbol.
    reads_sizes = any(n.target in SIZE_READING_CPP_KERNELS for n in ep.graph.nodes)
    dispatcher = enable_python_dispatcher() if reads_sizes else contextlib.nullcontext()
    with fake_kernel_fixes(), fake.mode, dispatcher, fx_traceback.preserve_node_meta():
        gm = make_fx(step, tracing_mode="real")(*graph_args, *grad_args, *opt_args)
    _check_no_specialisation(fake.shape_env, symbols)
    return _finish(gm, names, roles, fqns, recorder, grad_names, param_pos, fake, symbols)


def _check_no_specialisation(shape_env: ShapeEnv, symbols: set[sympy.Symbol]) -> None:
    """A size symbol fixed to its example value during the re-trace would price every later kernel at that
    size: refuse, never a silently smaller step."""
    fixed = {s: v for s, v in shape_env.replacements.items() if s in symbols and getattr(v, "is_number", False)}
    if fixed:
        names = ", ".join(f"{s}={v}" for s, v in sorted(fixed.items(), key=lambda kv: str(kv[0])))
        raise UnsupportedError(f"re-tracing the step fixed symbolic size(s) {names} to the trace's example value (an "
                           f"op of the graph reads sizes as plain integers); analyse without --train/--amp, or "
                           f"export with static shapes")


def _grad_buffers(fake: _FakeFactory, graph_args: list[Any], names: list[str], roles: list[str],
                  fqns: list[str | None], param_pos: list[int], device: torch.device) -> list[Any]:
    """One ``.grad`` placeholder per (unique) parameter, like it (``grad_<param placeholder>``);
    appended to ``names``/``roles``/``fqns`` in place."""
    bufs = []
    for p in param_pos:
        bufs.append(fake.tensor(graph_args[p], device))
        names.append(f"grad_{names[p]}")
        roles.append(ROLE_GRAD)
        fqns.append(fqns[p])
    return bufs


def _accumulate_into(loss_val: torch.Tensor, params: list[torch.Tensor],
                     bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``loss.backward()`` with every ``.grad`` already allocated: autograd's AccumulateGrad adds each
    new gradient into its buffer in place (``add_``) as soon as it is produced, as in eager."""
    for p, b in zip(params, bufs):
        p.grad = b
    loss_val.backward()
    for p, b in zip(params, bufs):
        if p.grad is not b:
            raise RuntimeError(f"autograd replaced a resident .grad buffer of shape {tuple(b.shape)}")
    return bufs


def _accumulated_grad(buf: torch.Tensor, tracer: Any) -> str | None:
    """The node of the new gradient that backward added into ``buf`` (None: the parameter got none).
    make_fx points an in-place op's tensor at the op's node, so ``buf`` now traces as its ``add_``."""
    node = get_proxy_slot(buf, tracer).proxy.node
    if node.target is torch.ops.aten.add_.Tensor and isinstance(node.args[1], fx.Node):
        return node.args[1].name
    return None


def _optimizer_step(opt_cls: Any, opt_kwargs: dict[str, Any], state_keys: tuple[str, ...], with_step: bool,
                    params: list[torch.Tensor], grads: Sequence[torch.Tensor], state: list[Any]) -> Any:
    """Run ``torch.optim``'s own step (foreach or its loop, as ``opt_kwargs`` say) on the traced params with
    pre-allocated state."""
    n = len(params)
    opt = opt_cls(params, **opt_kwargs)  # params are the graph's leaf inputs: updated in place
    for i, p in enumerate(params):
        st: dict[str, Any] = {key: state[k * n + i] for k, key in enumerate(state_keys)}
        if with_step:
            st["step"] = state[len(state_keys) * n + i]
        if st:
            opt.state[p] = st
        p.grad = grads[i]
    opt.step()
    return opt


def _finish(gm: fx.GraphModule, names: list[str], roles: list[str], fqns: list[str | None],
            recorder: _PhaseRecorder, grad_names: list[str | None], param_pos: list[int],
            fake: _FakeFactory, symbols: set[sympy.Symbol]) -> TracedProgram:
    """Name placeholders after the export, attach phases and module stacks, collect the maps."""
    _drop_profiler_nodes(gm.graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_roles: dict[str, str] = {}
    param_names: dict[str, str] = {}
    for node, name, role, fqn in zip(placeholders, names, roles, fqns):
        node._rename(name)
        node.target = node.name
        input_roles[node.name] = role
        if role == ROLE_PARAM and fqn is not None:
            param_names[node.name] = fqn
    phases = {n.name: recorder.by_name.get(n.name, PHASE_FORWARD)
              for n in gm.graph.nodes if n.op == "call_function"}
    _copy_module_stacks(gm.graph, phases)
    _label_accumulations(gm.graph, input_roles)
    for node in gm.graph.nodes:
        if node.name in phases:
            node.meta[META_PHASE] = phases[node.name]
    gm.recompile()
    grad_nodes = {g: str(fqns[p]) for g, p in zip(grad_names, param_pos) if g is not None}
    used: set[sympy.Symbol] = set()
    for node in gm.graph.nodes:
        used |= _symbols_of(node.meta.get("val"))
    symbol_map = {s: s for s in sorted(used & symbols, key=str)}
    return TracedProgram(gm, input_roles, phases, symbol_map, param_names, grad_nodes)


def _label_accumulations(graph: fx.Graph, input_roles: dict[str, str]) -> None:
    """--resident-grads: an AccumulateGrad ``add_`` into a ``.grad`` buffer belongs to the module of
    the gradient it adds (for breakdowns and the layer pattern of boomfx/training/expand.py). Each
    AccumulateGrad is an autograd node of its own, but all share one sequence number (the largest):
    drop it, so two adjacent ones do not read as one node (analyze.py ``_eager_autograd_liveness``)."""
    for node in graph.nodes:
        if node.target is not torch.ops.aten.add_.Tensor or not isinstance(node.args[0], fx.Node):
            continue
        if input_roles.get(node.args[0].name) != ROLE_GRAD:
            continue
        node.meta.pop("seq_nr", None)
        new_grad = node.args[1]
        if isinstance(new_grad, fx.Node) and "nn_module_stack" in new_grad.meta:
            node.meta["nn_module_stack"] = new_grad.meta["nn_module_stack"]


def _drop_profiler_nodes(graph: fx.Graph) -> None:
    """``Optimizer.step``'s ``record_function`` markers are traced as ops; they launch no kernel."""
    profiler_ops = (torch.ops.profiler._record_function_exit._RecordFunction,
                    torch.ops.profiler._record_function_enter_new.default)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in profiler_ops and not node.users:
            graph.erase_node(node)


def _copy_module_stacks(graph: fx.Graph, phases: dict[str, str]) -> None:
    """Backward nodes inherit ``nn_module_stack`` from the forward node with the same ``seq_nr``
    (autograd's sequence number), as aot_autograd's ``copy_fwd_metadata_to_bw_nodes`` does, and
    ``META_NATIVE_LOOP``: the backward of a C++ loop's step repeats the same few ops every step too."""
    by_seq: dict[int, Any] = {}
    native: set[int] = set()
    for node in graph.nodes:
        if phases.get(node.name) == PHASE_FORWARD and "seq_nr" in node.meta:
            if "nn_module_stack" in node.meta:
                by_seq.setdefault(node.meta["seq_nr"], node.meta["nn_module_stack"])
            if node.meta.get(META_NATIVE_LOOP):
                native.add(node.meta["seq_nr"])
    for node in graph.nodes:
        if phases.get(node.name) != PHASE_BACKWARD:
            continue
        if "nn_module_stack" not in node.meta:
            stack = by_seq.get(node.meta.get("seq_nr", -1))
            if stack is not None:
                node.meta["nn_module_stack"] = dict(stack)
        if node.meta.get("seq_nr", -1) in native:
            node.meta[META_NATIVE_LOOP] = True


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def build_training_program(ep: ExportedProgram, optimizer: str = "adamw", amp: str | None = None,
                           checkpoint: bool = False, loss: str = "auto", *, fused_attention: bool = True,
                           optimizer_kwargs: dict[str, Any] | None = None,
                           checkpoint_layers: Sequence[str] = (), resident_grads: bool = False,
                           param_dtype: str | None = None, foreach: bool = True) -> TracedProgram:
    """Trace forward + loss + backward + ``torch.optim`` step of ``ep`` on fake tensors.

    Args:
        ep: an inference export (meta-device weights are fine); its symbols are kept.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``, or ``"none"``: forward and backward only (the
            gradients are outputs of the step).
        foreach: the optimizer's foreach implementation (eager's default on GPU) or, ``False``, its
            per-parameter loop (eager's default on CPU); an explicit ``optimizer_kwargs["foreach"]`` wins.
        amp: ``None``, ``"bf16"`` or ``"fp16"`` (autocast, fp32 master weights; fp16 adds
            GradScaler's unscale and update kernels).
        checkpoint: checkpoint each instance of the model's main layer list.
        checkpoint_layers: checkpoint only these instances of it (``["h.0", "h.2"]``, module paths);
            when non-empty it wins over ``checkpoint``. Unknown names raise ``OptionError``.
        loss: ``"auto"`` (scalar first output as is; cross-entropy when the program takes
            ``labels`` or its first output is a language model's logits, see ``token_logits``; else
            mean of the first output), ``"mean"``, ``"cross_entropy"`` (adds a
            ``labels`` input if the export has none) or ``"output"``.
        fused_attention: call CUDA's flash/efficient attention kernels for SDPA, as a GPU
            would; ``False`` keeps the composite op, so real CPU tensors can run the graph (tests).
        optimizer_kwargs: extra ``torch.optim`` arguments (lr, momentum, weight_decay...).
        resident_grads: the steady state of ``zero_grad(set_to_none=False)`` (or gradient
            accumulation): a ``grad_...`` placeholder per parameter, resident before the step;
            backward adds each new gradient into it in place (``add_``) right after producing it,
            the optimizer reads it and a foreach zero ends the step. ``grad_nodes`` then names
            the new gradients (temporaries freed by their ``add_``).
        param_dtype: ``"bfloat16"``/``"float16"``: the parameters are traced in this dtype without
            autocast (FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``, amp.ComputeDtypePolicy);
            the optimizer then runs on them too, and the FSDP rewrite gives it the fp32 shards.

    Returns:
        TracedProgram whose placeholders are named like the export's (``p_...``), plus
        ``exp_avg_p_...``/``exp_avg_sq_p_...``/``step_p_...`` (Adam) or ``momentum_buffer_p_...``
        (and ``grad_p_...`` with ``resident_grads``).
    """
    if optimizer not in _OPTIMIZERS and optimizer != NO_OPTIMIZER:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZERS)}, got {optimizer!r}")
    if loss not in ("auto", "mean", "cross_entropy", "output"):
        raise ValueError(f"unknown loss {loss!r}")
    return _trace(ep, train=True, optimizer=optimizer, optimizer_kwargs={"foreach": foreach, **(optimizer_kwargs or {})},
                  amp=amp, checkpoint=checkpoint, loss=loss, fused_attention=fused_attention,
                  checkpoint_layers=tuple(checkpoint_layers or ()), resident_grads=resident_grads,
                  param_dtype=param_dtype)


def build_inference_program(ep: ExportedProgram, amp: str | None = None, *,
                            fused_attention: bool = True) -> TracedProgram:
    """Trace the forward of ``ep`` (no grad) on fake tensors, optionally under autocast."""
    return _trace(ep, train=False, optimizer="sgd", optimizer_kwargs={}, amp=amp, checkpoint=False,
                  loss="auto", fused_attention=fused_attention)
