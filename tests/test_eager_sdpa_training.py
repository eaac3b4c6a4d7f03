"""Training steps traced with transformers' eager attention calls (passes/eager_sdpa.py: eager_attention_export).

Eagerly (no padding, as many queries as keys) transformers' Llama calls ``scaled_dot_product_attention`` with
``is_causal=True``, no mask and its 2 key/value heads unrepeated (``enable_gqa``); the export built a causal
mask and repeated the heads to 4. A training step is re-traced from the export, so its backward and saved
tensors follow whichever forward it is traced from.

Truth: what the eager nn.Module does while it trains: its ``F.scaled_dot_product_attention`` arguments (a
TorchFunctionMode), the aten attention kernels it runs forward and backward (a TorchDispatchMode), the
profiler's peak of its real training step on this CPU (foreach AdamW), and its logits split over 2
tensor-parallel ranks. ``--no-python-locals`` is checked against ``ep.module()``'s real step (what ``boomfx
validate --train`` runs), which keeps the mask.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.export import Dim
from torch.utils._python_dispatch import TorchDispatchMode

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import cpu_spec
from boomfx.core.program import EAGER_PROGRAM, ProgramOptions
from boomfx.frontend import trace_cache
from boomfx.frontend.capture import capture, resolve_bindings
from boomfx.memory.live_bytes import profiler_peak_bytes
from test_eager_sdpa import _RecordSDPA

BATCH, SEQ, VOCAB = 4, 128, 256
EAGER = ProgramOptions(train=True, optimizer="adamw", target_kind="cpu", foreach=True)
GRAPH = ProgramOptions(train=True, optimizer="adamw", target_kind="cpu", foreach=True, python_locals=False)
TOLERANCE = 0.005


def _llama() -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, use_cache=False)
    return tf.LlamaForCausalLM(cfg)


def _export(model: torch.nn.Module, ids: torch.Tensor) -> torch.export.ExportedProgram:
    dims = {"input_ids": {0: Dim("batch", max=512), 1: Dim("seq", min=2, max=512)}}
    return torch.export.export(model.eval(), (), {"input_ids": ids}, dynamic_shapes=dims, strict=False)


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    """The model, its export at batch 4 x 128 tokens, and the two captures of its training step (traced once)."""
    pytest.importorskip("transformers")
    model = _llama()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ep = _export(model, ids)
    return {"model": model, "ids": ids, "ep": ep, "eager": capture(ep, options=EAGER),
            "graph": capture(ep, options=GRAPH)}


def _cross_entropy(logits: torch.Tensor) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, logits.shape[:-1], generator=torch.Generator().manual_seed(0))
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())


def _attention_kernel(op: Any, args: tuple, kwargs: dict, shape: Any) -> tuple[str, bool, bool, int, int]:
    """(kernel, mask given, is_causal, query heads, key heads) of an aten attention kernel's call, its forward's
    or its backward's (both name their arguments query, key, is_causal, attn_mask)."""
    names = [a.name for a in op._schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    return (op._schema.name.split("::")[-1], bound.get("attn_mask") is not None, bool(bound.get("is_causal")),
            int(shape(bound["query"])[1]), int(shape(bound["key"])[1]))


class _RecordKernels(TorchDispatchMode):
    """The aten attention kernels a real run calls, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "scaled_dot_product" in func._schema.name:
            self.kernels.append(_attention_kernel(func, args, kwargs, lambda t: t.shape))
        return func(*args, **kwargs)


def _traced_kernels(program) -> list[tuple]:
    return [_attention_kernel(n.target, n.args, n.kwargs, lambda a: a.meta["val"].shape)
            for n in program.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and "scaled_dot_product" in n.target._schema.name]


def test_the_training_step_runs_the_eager_modules_attention_kernels(llama) -> None:
    """The module passes no mask, is_causal and 2 KV heads with enable_gqa; CPU flash attention runs on them
    forward and backward (grads of the 2 heads). The traced step (python_locals, the default) runs the same
    kernels on the same heads; --no-python-locals keeps the export's mask and heads repeated to 4."""
    model = llama["model"].train()
    with _RecordSDPA() as calls, _RecordKernels() as kernels:
        _cross_entropy(model(input_ids=llama["ids"]).logits).backward()
    model.zero_grad(set_to_none=True)
    assert calls.calls == [(False, True, True, 2)] * 2
    flash = "_scaled_dot_product_flash_attention_for_cpu"
    assert Counter(kernels.kernels) == Counter({(flash, False, True, 4, 2): 2,
                                                (flash + "_backward", False, True, 4, 2): 2})
    assert Counter(_traced_kernels(llama["eager"])) == Counter(kernels.kernels)
    assert Counter(_traced_kernels(llama["graph"])) == Counter({(flash, True, False, 4, 4): 2,
                                                                (flash + "_backward", True, False, 4, 4): 2})


def _predicted_peak(program) -> int:
    bindings = resolve_bindings(program, {}, BATCH, SEQ)
    memory = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none")).evaluate(bindings).report.memory
    return memory.peak_live_bytes - memory.resident_bytes


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def _real_peak(module: torch.nn.Module, ids: torch.Tensor) -> int:
    """Profiler peak of one training step above its start (after a warm-up: AdamW's state exists), as
    benchmarks/cpu_accuracy.py's make_step runs it: the logits dropped once reduced, foreach AdamW."""
    opt = torch.optim.AdamW(list(module.parameters()), foreach=True)

    def step() -> None:
        _cross_entropy(_logits(module(input_ids=ids))).backward()     # no local holds the logits
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    return profiler_peak_bytes(step)


def test_training_peak_is_the_eager_modules(llama) -> None:
    """Predicted peak above the step's start against the profiler's: the nn.Module's step for the default
    (6,465,540 B predicted vs 6,465,544 B real; traced with the export's mask and repeated K/V, as before:
    7,251,972 B, +12.2%), and ep.module()'s step (the export's graph, what validate runs: 7,251,976 B) for
    --no-python-locals, which is that much above the module's."""
    module_real = _real_peak(llama["model"].train(), llama["ids"])
    graph_real = _real_peak(llama["ep"].module(), llama["ids"])
    eager, graph = _predicted_peak(llama["eager"]), _predicted_peak(llama["graph"])
    assert abs(eager - module_real) <= TOLERANCE * module_real, (eager, module_real)
    assert abs(graph - graph_real) <= TOLERANCE * graph_real, (graph, graph_real)
    assert graph - eager >= 0.05 * module_real      # the saved masks and repeated heads: 0.75 MiB here


def test_compile_keeps_the_exports_attention_and_its_own_trace(llama, tmp_path) -> None:
    """torch.compile (torch < 2.14) never lets transformers skip the mask, so --compile's eager step keeps it; the
    trace kept per archive (frontend/trace_cache.py) is not shared between the two."""
    path = str(tmp_path / "llama.pt2")
    torch.export.save(llama["ep"], path)
    trace_cache.clear_traces()
    try:
        plain = capture(path, options=EAGER)
        compiled = capture(path, options=ProgramOptions(train=True, target_kind="cpu", foreach=True, compile=True))
        again = capture(path, options=EAGER)
    finally:
        trace_cache.clear_traces()
    assert all(not k[1] for k in _traced_kernels(plain)) and again.gm is plain.gm
    kept = compiled.derived[EAGER_PROGRAM]
    assert kept.gm is not plain.gm and all(k[1] for k in _traced_kernels(kept)) and _traced_kernels(kept)


def test_tensor_parallel_ranks_trace_the_eager_attention(llama) -> None:
    """tp=2: each rank's traced step runs causal flash attention on its 2 query heads and 1 unrepeated KV head;
    the rewritten rank graphs (run in lockstep on their weight slices) reproduce the unsharded model's logits."""
    from boomfx.distributed.plan import ParallelConfig
    from boomfx.distributed.tensor_parallel import module_plan, shard_export, tp_rank_program
    from boomfx.frontend.capture import export_roles, symbols_of
    from boomfx.passes.eager_sdpa import eager_attention_export
    from tp_lockstep import plain_layout, run_ranks

    ep, ids, program = llama["ep"], llama["ids"], llama["eager"]
    cfg = ParallelConfig(tp=2)
    flash = "_scaled_dot_product_flash_attention_for_cpu"
    assert Counter(_traced_kernels(tp_rank_program(program, cfg))) == Counter(
        {(flash, False, True, 2, 1): 2, (flash + "_backward", False, True, 2, 1): 2})
    plan = module_plan(program, cfg)
    sharded = shard_export(ep, plan, 2)
    roles = export_roles(sharded)
    rewritten = eager_attention_export(sharded, symbols_of(sharded, roles), roles)
    assert rewritten is not sharded
    with torch.no_grad():
        want = ep.module()(input_ids=ids).logits
    for out in run_ranks(rewritten, ep, 2, plain_layout(plan), [ids]):
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


def test_a_cuda_step_in_bf16_runs_flash_attention_on_the_unrepeated_heads(llama) -> None:
    """On a CUDA target the trace picks CUDA's kernel: bf16 without a mask is flash attention, which takes fewer
    key/value heads (torch's SDPA doc: GQA runs on flash and math on CUDA); the export's masked call was the
    memory-efficient kernel on repeated heads."""
    options = ProgramOptions(train=True, amp="bf16", target_kind="cuda")
    program = capture(llama["ep"], options=options)
    flash = "_scaled_dot_product_flash_attention"
    assert Counter(_traced_kernels(program)) == Counter({(flash, False, True, 4, 2): 2,
                                                         (flash + "_backward", False, True, 4, 2): 2})
