"""The real step ``boomfx validate`` measures: the same step the prediction describes, run on this machine.

Inference is the exported graph under ``no_grad``. Training is what ``--train`` traces
(boomfx/training/trace.py): the loss ``resolved_loss`` names (the scalar output itself; cross-entropy of
the first floating output against next-token labels drawn once and kept, as a data loader's batch is;
else its ``mean``), ``loss.backward()``, a ``torch.optim`` step (foreach, or its per-parameter loop with
``foreach=False``: the prediction's ``ProgramOptions.uses_foreach``), ``zero_grad(set_to_none=True)`` (or, with
``resident_grads``, ``set_to_none=False``). ``optimizer="none"`` stops after the backward: the
micro-batch step of gradient accumulation (the gradients are dropped at the end of the step, so the
next one starts from the same state). ``compile`` wraps the model and its loss in ``torch.compile``
(the optimizer stays eager, as ``torch.compile(model)`` leaves it). ``amp`` runs the forward under
``torch.autocast`` of the device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

# torch.optim classes of the optimizers --train knows (boomfx/training/trace.py traces the same ones)
_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class RealStep:
    """One callable step and the state it keeps between calls."""

    run: Callable[[], None]
    optimizer: Optional[torch.optim.Optimizer]
    module: torch.nn.Module

    def resident_state_bytes(self) -> int:
        """Bytes of optimizer state (allocated by the first step, resident afterwards)."""
        if self.optimizer is None:
            return 0
        return sum(t.untyped_storage().nbytes() for s in self.optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def resident_grad_bytes(self) -> int:
        return sum(p.grad.untyped_storage().nbytes() for p in self.module.parameters() if p.grad is not None)


def first_output(out: Any) -> torch.Tensor:
    """The first floating tensor among the program's flat outputs (what ``--train``'s loss reduces).

    Flat order (pytree leaves: the order of the graph's outputs, which the trace's loss reads), nested
    containers included.
    """
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise StopIteration("the program returns no floating tensor to reduce to a loss")


def _loss(out: Any, loss: str, labels: Optional[torch.Tensor]) -> torch.Tensor:
    first = first_output(out)
    if loss == "output" or first.dim() == 0:
        return first
    if loss == "cross_entropy":
        assert labels is not None
        # fp32 logits first, as the trace's loss does under --amp (and transformers' and torchtitan's losses)
        return torch.nn.functional.cross_entropy(first.float().flatten(0, -2), labels.flatten())
    return first.float().mean()


class _WithLoss(torch.nn.Module):
    """Model + loss as one module, so ``torch.compile`` fuses the loss into the graphs as predicted.
    Cross-entropy's labels are drawn at the first call (their shape is the logits' without the
    vocabulary) and kept, resident like the trace's ``labels`` input."""

    def __init__(self, model: torch.nn.Module, loss: str) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.labels: Optional[torch.Tensor] = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model(*args, **kwargs)
        if self.loss == "cross_entropy" and self.labels is None:
            given = kwargs.get("labels")
            if given is not None:
                self.labels = given
            else:
                logits = first_output(out)
                gen = torch.Generator().manual_seed(0)
                self.labels = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=gen).to(logits.device)
        return _loss(out, self.loss, self.labels)


def _autocast(device: torch.device, amp: Optional[str]) -> contextlib.AbstractContextManager:
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


def _compiled_bodies(module: torch.nn.Module) -> None:
    """Generate the code of every lazily compiled fx submodule of ``module`` now.

    boomfx's loader builds an export's GraphModules lazily (frontend/deserialize.py), so ``ep.module()`` holds the
    bodies of higher-order ops (``wrap_with_set_grad_enabled``: a ``torch.no_grad()`` region such as PhiMoE's
    sparse mixer) as ``_LazyGraphModule``s, whose first-call code path Dynamo refuses to trace (``_lazy_forward``
    is marked skipped): the step then broke into a compiled graph per region with the regions run eagerly
    between them, holding each graph's outputs in the frame, where a user compiling the model gets one graph
    (PhiMoE's compiled inference measured 10.68 MiB with the breaks, 8.50 MiB without)."""
    for sub in module.modules():
        if hasattr(sub, "real_recompile"):       # a no-op on one already generated
            sub.real_recompile()


def build_step(module: torch.nn.Module, args: tuple, kwargs: dict, *, train: bool, optimizer: str = "adamw",
               amp: Optional[str] = None, compile: bool = False, resident_grads: bool = False,
               device: torch.device | str = "cpu", loss: str = "mean", foreach: Optional[bool] = True) -> RealStep:
    """The step as a closure over real tensors (first call not made: warm-up is the caller's).
    ``loss``: ``"cross_entropy"``, ``"mean"`` or ``"output"``, as ``training.trace.resolved_loss`` names it;
    ``foreach``: the optimizer's argument (None would be torch's default for the parameters' device)."""
    device = torch.device(device)
    if compile:
        # Dynamo caches compiled code per code object: every training step here compiles the same
        # ``_WithLoss.forward``, and past its recompile limit (8 compilations: a few models validated in one
        # process) dynamo silently runs it eagerly: the "compiled" real step measured eager time and memory
        torch._dynamo.reset()
        _compiled_bodies(module)
    if not train:
        fn = torch.compile(module) if compile else module

        def infer() -> None:
            with torch.no_grad(), _autocast(device, amp):
                fn(*args, **kwargs)
        return RealStep(infer, None, module)
    loss_fn: Callable[..., torch.Tensor] = _WithLoss(module, loss)
    if compile:
        loss_fn = torch.compile(loss_fn)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = _OPTIMIZERS[optimizer](params, foreach=foreach) if optimizer != "none" else None

    def train_step() -> None:
        with _autocast(device, amp):
            loss = loss_fn(*args, **kwargs)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=not resident_grads)
        elif not resident_grads:
            for p in params:      # the micro-batch's gradients leave with the step
                p.grad = None
        # resident_grads without an optimizer: the .grad buffers keep accumulating, as in accumulation
    return RealStep(train_step, opt, module)


def densify_optimizer_state(opt: Optional[torch.optim.Optimizer], seed: int = 0) -> None:
    """Dense Adam moments, as after a long run on varied data (benchmarks/cpu_accuracy.py explains why:
    a short warm-up leaves ``exp_avg_sq`` exactly zero in untouched embedding rows, and this CPU's
    vectorised ``sqrt`` is ~8x slower on zeros)."""
    if opt is None:
        return
    gen = torch.Generator().manual_seed(seed)
    for state in opt.state.values():
        if "exp_avg" in state and "exp_avg_sq" in state:
            shape = state["exp_avg"].shape
            state["exp_avg"].copy_(torch.randn(shape, generator=gen) * 1e-4)
            state["exp_avg_sq"].copy_(torch.rand(shape, generator=gen) * 1e-8 + 1e-10)
