"""transformers' Python per step, measured on this host: the host overhead of a ``generate``-style decode
loop (``--kv-write concat`` on a CPU), outside every kernel the step prices.

A transformers decode step runs each module's ``forward`` in Python (argument handling, the cache's
``update``, masks and positions) around the kernels. On a CPU that time adds to the kernels' (one
thread issues and runs them): at batch 1 it was 20-35% of a decode step of a 4-layer model here. It
scales with the module calls the export traced (``ServingModel.module_calls``), so it is measured per
module call, on calibration Llamas of 1 and 3 layers (batch 1, 32 tokens of context) built from a
config (no download): (real step - the step priced from kernels measured here) / module calls, summed
over both. ``boomfx serve --collect --kv-write concat`` on a CPU stores it in the database
(``MODULE_CALL``, a host row like ``kernels_db/host_overheads.py``'s); pricing under the concat rule
reads it back (``ServingSetup.pricer``). Checked on models it was not measured on:
``benchmarks/results/serving_cpu_threads2.md`` (Llama, GPT-BigCode, Falcon, Qwen2-MoE).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from boomfx.kernels_db.host_overheads import MODULE_CALL, host_key

CALIBRATION_LAYERS = (1, 3)
CALIBRATION_CONTEXT = 32
CALIBRATION_ITERS = 21
CALIBRATION_VOCAB = 4096


def calibration_llama(layers: int) -> torch.nn.Module:
    """A transformers Llama of ``layers`` layers (hidden 256, GQA 4/2 heads), random weights, eval mode."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=2048, vocab_size=CALIBRATION_VOCAB,
                         attention_dropout=0.0)
    return tf.LlamaForCausalLM(cfg).eval()


def plain_export(model: torch.nn.Module, vocab: int) -> Any:
    """``model(input_ids)`` exported with a dynamic batch and sequence, without its cache."""
    from torch.export import Dim
    model.config.use_cache = False
    try:
        return torch.export.export(model, (), {"input_ids": torch.randint(0, vocab, (2, 64))},
                                   dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=256),
                                                                 1: Dim("seq", min=2, max=2048)}}, strict=False)
    finally:
        model.config.use_cache = True


def median_step_s(step: Callable[[], Any], iters: int, before: Callable[[], Any] = lambda: None,
                  warmup: int = 2) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds of this thread) of ``step`` after ``warmup`` runs."""
    for _ in range(warmup):
        before()
        step()
    wall, cpu = [], []
    for _ in range(iters):
        before()
        c0, t0 = time.thread_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def time_decode_step(model: torch.nn.Module, batch: int, context: int, iters: int, vocab: int) -> tuple[float, float]:
    """A real decode step of ``batch`` sequences at ``context`` tokens (the new one included) into a
    ``DynamicCache``, greedy argmax included, as ``generate`` runs it: (median wall s, median CPU s)."""
    import transformers as tf
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (batch, context - 1)), past_key_values=cache, use_cache=True)
    ids = torch.randint(0, vocab, (batch, 1))

    def step() -> None:
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            out.logits[:, -1].float().argmax(-1)

    def back_to_context() -> None:     # transformers 5.x: crop(-n) removes the last n tokens
        extra = cache.get_seq_length() - (context - 1)
        if extra > 0:
            cache.crop(-extra)
    return median_step_s(step, iters, before=back_to_context)


def measure_module_call_ns(workdir: Optional[Path] = None, iters: int = CALIBRATION_ITERS,
                           clock: str = "wall") -> tuple[float, list[dict[str, float]]]:
    """transformers' Python per module call on this host at torch's current threads, and the calibration
    rows (layers, module calls, predicted and real step ns). ``clock="thread"``: this thread's CPU time
    (one intra-op thread; the database's clock then)."""
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.capture import capture
    from boomfx.serving.collect import collect_serving
    from boomfx.serving.serve import setup
    from boomfx.serving.steps import KV_WRITE_CONCAT, Step
    spec = cpu_spec()
    step = Step((CALIBRATION_CONTEXT,))
    options = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for layers in CALIBRATION_LAYERS:
            model = calibration_llama(layers)
            program = capture(plain_export(model, CALIBRATION_VOCAB), options=ProgramOptions(target_kind="cpu"))
            plain = setup(program, spec, db="none", **options)
            db = Path(tmp) / f"calibration{layers}.sqlite"
            collect_serving(plain.pricer(kv_write=KV_WRITE_CONCAT), [step], db, spec)
            s = setup(program, spec, db=str(db), **options)
            predicted = s.pricer(kv_write=KV_WRITE_CONCAT).step_time(step).total_ns
            wall, cpu = time_decode_step(model, 1, CALIBRATION_CONTEXT, iters, CALIBRATION_VOCAB)
            real = (cpu if clock == "thread" else wall) * 1e9
            rows.append({"layers": layers, "module_calls": s.model.module_calls, "pred_ns": predicted,
                         "real_ns": real, "gap_ns": real - predicted})
    per_call = sum(r["gap_ns"] for r in rows) / sum(r["module_calls"] for r in rows)
    return max(per_call, 0.0), rows


def collect_module_call(store: Any, measurer: Any) -> Optional[float]:
    """Measure and store ``MODULE_CALL`` unless the store has it for the measurer's host; None without
    transformers (nothing to measure)."""
    from boomfx.kernels_db.measure import Measurement
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    fingerprint = measurer.fingerprint()
    key = host_key(MODULE_CALL)
    with store:
        held = store.get(fingerprint, key.key_hash)
    if held is not None:
        return held.median_ns
    value, _ = measure_module_call_ns()
    with store:
        store.put(Measurement(value, value, value, len(CALIBRATION_LAYERS), value, 0,
                              measurer.source).record(fingerprint, key))
    return value
