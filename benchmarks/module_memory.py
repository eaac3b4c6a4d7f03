"""Eager inference memory of the nn.Module people run, against boomfx's prediction with and without the
model's Python locals (``passes/python_locals.py``).

For each model (the 5 of ``benchmarks/cpu_accuracy.py``, on which the rules were designed; held out: the 14
of ``benchmarks/broad_cpu_accuracy.py`` and 4 decoders with a 256-token vocabulary, whose peak is in the
layers rather than the logits): export it (inference, ``strict=False``), predict the
peak above the step's start on this CPU with no database (``python_locals`` on: the module's frees;
off: the graph's), and measure the profiler's peak of one ``no_grad`` forward of the nn.Module
(``model(**inputs)``) and of the export's graph (``ep.module()``) after a warm-up. Memory does not
depend on the machine's load.

Run: ``python benchmarks/module_memory.py`` (writes ``benchmarks/results/module_memory.{json,md}``).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

DESIGNED_ON = ("gpt2", "bert", "llama", "vit", "resnet")          # cpu_accuracy.py's
HELD_OUT = ("opt", "qwen2", "gptbigcode", "mistral", "mixtral", "gptneox", "roberta", "distilbert", "t5", "deit",
            "swin", "convnext", "resnet", "mobilenetv2")             # broad_cpu_accuracy.py's


SMALL_VOCAB = ("llama", "qwen2", "gpt2", "opt")   # decoders whose logits do not make the peak (also held out)


def _small_vocab_decoder(name: str) -> torch.nn.Module:
    """A 2-layer decoder with a 256-token vocabulary: at 2 x 512 tokens the layers, not the logits, peak."""
    import transformers as tf
    torch.manual_seed(0)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=688,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=2, hidden_size=256, intermediate_size=704,
                                                  num_attention_heads=4, num_key_value_heads=1, vocab_size=256))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=256, n_positions=1024,
                                                bos_token_id=0, eos_token_id=0))
    return tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, hidden_size=256, ffn_dim=1024, num_attention_heads=4,
                                          vocab_size=256, max_position_embeddings=1024, word_embed_proj_dim=256))


def _case(suite: str, name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], Any, dict[str, int]]:
    if suite == "small_vocab":
        model = _small_vocab_decoder(name)
        model.config.use_cache = False
        return model, {"input_ids": torch.randint(0, 256, (2, 512))}, None, {}
    if suite == "cpu_accuracy":
        import cpu_accuracy
        return cpu_accuracy.build(name)
    import broad_cpu_accuracy
    model, kwargs = broad_cpu_accuracy.build(name)
    return model, kwargs, None, {}


def _predicted(ep: Any, dims: dict[str, int], python_locals: bool) -> int:
    from boomfx.analysis.analysis import Analysis, AnalyzeOptions
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.capture import capture, resolve_bindings
    program = capture(ep, options=ProgramOptions(target_kind="cpu", python_locals=python_locals))
    bindings = resolve_bindings(program, {}, dims.get("batch"), dims.get("seq")) if dims else {}
    memory = Analysis(program, cpu_spec(), AnalyzeOptions("cpu", db="none")).evaluate(bindings).report.memory
    return int(memory.peak_live_bytes - memory.resident_bytes)


def _real(run: Any, kwargs: dict[str, torch.Tensor]) -> int:
    from boomfx.memory.live_bytes import profiler_peak_bytes

    def step() -> None:
        with torch.no_grad():
            run(**kwargs)
    step()
    return int(profiler_peak_bytes(step))


def measure(suite: str, name: str) -> dict[str, Any]:
    model, kwargs, dynamic_shapes, dims = _case(suite, name)
    model.eval()
    ep = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    row: dict[str, Any] = {"suite": suite, "model": name, "held_out": suite != "cpu_accuracy"}
    row["pred_locals"] = _predicted(ep, dims, True)
    row["pred_graph"] = _predicted(ep, dims, False)
    row["real_module"] = _real(model, kwargs)
    row["real_graph"] = _real(ep.module(), kwargs)
    row["err_locals_vs_module"] = row["pred_locals"] / row["real_module"] - 1.0
    row["err_graph_vs_module"] = row["pred_graph"] / row["real_module"] - 1.0
    row["err_graph_vs_graph"] = row["pred_graph"] / row["real_graph"] - 1.0
    return row


def main() -> int:
    import transformers
    rows, failures = [], []
    started = time.perf_counter()
    for suite, names in (("cpu_accuracy", DESIGNED_ON), ("broad_cpu_accuracy", HELD_OUT), ("small_vocab", SMALL_VOCAB)):
        for name in names:
            try:
                row = measure(suite, name)
            except Exception as exc:   # a model that cannot run is reported, not hidden
                failures.append({"model": f"{suite}:{name}", "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print(f"{suite}:{name} FAILED {failures[-1]['error']}", flush=True)
                continue
            rows.append(row)
            print(f"{suite:18} {name:12} module {row['real_module'] / 2**20:7.2f} MiB  locals "
                  f"{100 * row['err_locals_vs_module']:+6.1f}%  graph {100 * row['err_graph_vs_module']:+6.1f}%  "
                  f"(graph run {100 * row['err_graph_vs_graph']:+6.1f}%)", flush=True)
    summary = {}
    for label, pick in (("designed_on", lambda r: not r["held_out"]), ("held_out", lambda r: r["held_out"])):
        sel = [r for r in rows if pick(r)]
        for key in ("err_locals_vs_module", "err_graph_vs_module", "err_graph_vs_graph"):
            errs = [abs(r[key]) for r in sel]
            summary[f"{label}:{key}"] = {"median_abs": statistics.median(errs) if errs else None,
                                         "worst_abs": max(errs) if errs else None}
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.perf_counter() - started),
            "command": " ".join(sys.argv)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "module_memory.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows,
                                                             "failures": failures}, indent=1))
    lines = ["# Eager inference memory: the nn.Module's peak vs boomfx", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['date']}. Peak above the step's start, "
             "profiler, one `no_grad` forward after a warm-up; predictions with no database. *locals*: "
             "`python_locals=True` (the default: the model's Python locals and arguments held, passes/python_locals.py); "
             "*graph*: `--no-python-locals` (frees at last use, as `ep.module()` runs). The rules were designed on the "
             "cpu_accuracy models; the broad_cpu_accuracy ones are held out.", "",
             "| suite | model | held out | real module | locals err | graph err | real graph run | graph err vs graph run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['suite']} | {r['model']} | {'yes' if r['held_out'] else 'no'} | "
                     f"{r['real_module'] / 2**20:.2f} MiB | {100 * r['err_locals_vs_module']:+.1f}% | "
                     f"{100 * r['err_graph_vs_module']:+.1f}% | {r['real_graph'] / 2**20:.2f} MiB | "
                     f"{100 * r['err_graph_vs_graph']:+.1f}% |")
    lines += ["", "| set | quantity | median abs | worst abs |", "|---|---|---|---|"]
    for key, v in summary.items():
        label, q = key.split(":")
        fmt = (lambda x: "n/a" if x is None else f"{100 * x:.1f}%")
        lines.append(f"| {label} | {q} | {fmt(v['median_abs'])} | {fmt(v['worst_abs'])} |")
    lines += ["", "Notes:", "",
              "- The decoders of broad_cpu_accuracy peak at their logits ([4 x 128, 4096] fp32 = 8 MiB), where locals "
              "change nothing; the small_vocab suite (256 tokens, 2 x 512) peaks inside the layers.",
              "- small_vocab decoders were over by 2-4% with the locals (2026-12-03). At Llama's predicted peak (in "
              "layer 1's MLP) every held tensor is one eager holds too (inputs_embeds, the loop's previous "
              "hidden_states, the norm output the MLP's argument keeps). The 0.5 MiB excess equals the causal mask, "
              "which the export materialises (create_causal_mask under tracing) and the graph run allocates. Since "
              "passes/eager_sdpa.py (2026-12-06: the eager module's SDPA calls, no mask, unrepeated KV heads) Qwen2 "
              "+4.0% -> +0.0% and OPT +2.1% -> +0.0%; Llama (+4.1%) and GPT-2 (+2.3%) did not move, so their "
              "excess is something else of the same size (not found)."]
    if failures:
        lines += ["", "Failures: " + "; ".join(f"{f['model']}: {f['error']}" for f in failures)]
    (RESULTS / "module_memory.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
