"""Serving ground truth on this CPU: real ``transformers`` prefill and decode steps with a KV cache
against ``boomfx serve``'s step prices (``--device cpu``, a kernel database collected here), the KV
bytes of the real cache tensors against the memory plan, and the speed of a 10,000-request simulation.

One command::

    python benchmarks/serving_cpu.py                     # all models
    python benchmarks/serving_cpu.py --models llama --iters 5

For each model (built from a config, random weights, no download: Llama-style GQA, GPT-BigCode MQA,
Falcon MQA, Qwen2-MoE; held out, ``--models gemma2,gptoss --out serving_cpu_eager``: Gemma-2 and GPT-OSS,
whose attention transformers runs written out):

1. export ``model(input_ids)`` (``strict=False``, dynamic batch and sequence, ``use_cache=False``);
2. real steps, as ``generate`` runs them (default threads, wall clock, median of ``--iters`` after
   warm-up): a prefill of P tokens into a fresh ``DynamicCache`` with logits for the last token only,
   and decode steps of B sequences with C tokens of context (the cache cropped back to C-1 tokens
   before each timed step); each step ends with a greedy ``argmax``;
3. the database: every call the serving steps price (``StepPricer.kernel_calls``: token-wise nodes at
   the step's token count, logits nodes at its sampled count, the attention, cache-write and sampler
   calls), measured with the protocol ``boomfx kernels collect`` uses, plus the host's cold-start costs;
4. predicted: ``StepPricer.step_time`` with the ``concat`` cache-write rule (``DynamicCache.update``
   appends with ``torch.cat``: the mechanism that makes a transformers decode step grow with context).

With ``--cache-export``, each model is also exported as a decode step that carries its cache
(``model(input_ids, past_key_values=DynamicCache)``, the cache dims dynamic) and its decode steps are
priced from that graph itself (``StepPricer.decode_from_graph``: the export's SDPA over the cached
context and its ``torch.cat`` cache writes), against the same real decode steps.

Writes ``benchmarks/results/serving_cpu.{json,md}``. The machine is shared: the load average is
recorded at the start and the end.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

VOCAB = 4096
MODELS = ("llama", "bigcode", "falcon", "qwen2moe")
PREFILL_LENS = (64, 256, 512)
DECODE_BATCHES = (1, 4, 16)
DECODE_CONTEXTS = (128, 512)


def build(name: str, layers: int = 4) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB)
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=2048, **common)
        model = tf.LlamaForCausalLM(cfg)
    elif name == "bigcode":
        cfg = tf.GPTBigCodeConfig(n_layer=4, n_embd=256, n_head=4, multi_query=True, n_positions=2048,
                                  bos_token_id=0, eos_token_id=0, **common)
        model = tf.GPTBigCodeForCausalLM(cfg)
    elif name == "falcon":
        cfg = tf.FalconConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, multi_query=True,
                              new_decoder_architecture=False, **common)
        model = tf.FalconForCausalLM(cfg)
    elif name == "gemma2":   # held out: attention written out (transformers has no SDPA path for it)
        cfg = tf.Gemma2Config(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, **common)
        model = tf.Gemma2ForCausalLM(cfg)
    elif name == "gptoss":   # held out: written out with attention sinks; windows past every context here
        cfg = tf.GptOssConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=256, num_local_experts=4,
                              num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              max_position_embeddings=2048, sliding_window=4096, **common)
        model = tf.GptOssForCausalLM(cfg)
    elif name == "qwen2moe":
        cfg = tf.Qwen2MoeConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688, moe_intermediate_size=256,
                                shared_expert_intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, **common)
        model = tf.Qwen2MoeForCausalLM(cfg)
    # held out (not in MODELS; added 2026-12-06 to check passes/eager_grouped_mm.py on MoE families it was not
    # written against): transformers' grouped-mm experts, 8 experts top-2, shapes like qwen2moe's
    elif name == "olmoe":
        cfg = tf.OlmoeConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=256, num_experts=8,
                             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=2048, **common)
        model = tf.OlmoeForCausalLM(cfg)
    elif name == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688, moe_intermediate_size=256,
                                num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=64, max_position_embeddings=2048, **common)
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise KeyError(name)
    for attr in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, 0.0)
    return model.eval()


def export(model: torch.nn.Module) -> Any:
    model.config.use_cache = False
    ep = torch.export.export(model, (), {"input_ids": torch.randint(0, VOCAB, (2, 64))},
                             dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=256),
                                                           1: Dim("seq", min=2, max=2048)}}, strict=False)
    model.config.use_cache = True
    return ep


# -- real steps ----------------------------------------------------------------------------------------

def keeps_one_logit(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def real_prefill(model: torch.nn.Module, p: int, iters: int) -> tuple[float, float]:
    import transformers as tf
    ids = torch.randint(0, VOCAB, (1, p))
    extra = {"logits_to_keep": 1} if keeps_one_logit(model) else {}

    def step() -> None:
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=tf.DynamicCache(config=model.config), use_cache=True, **extra)
            out.logits[:, -1].float().argmax(-1)
    from boomfx.serving.host_overhead import median_step_s
    return median_step_s(step, iters)


def real_decode(model: torch.nn.Module, b: int, ctx: int, iters: int) -> tuple[float, float]:
    from boomfx.serving.host_overhead import time_decode_step
    return time_decode_step(model, b, ctx, iters, VOCAB)


def real_cache_bytes(model: torch.nn.Module, b: int, tokens: int) -> int:
    import transformers as tf
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (b, tokens)), past_key_values=cache, use_cache=True)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


# -- prediction ------------------------------------------------------------------------------------------

class DecodeStep(torch.nn.Module):
    """``model(input_ids, past_key_values)`` returning logits and the grown cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, past_key_values: Any) -> Any:
        out = self.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True)
        return out.logits, out.past_key_values


def export_decode_step(model: torch.nn.Module) -> Any:
    """The decode step with a ``DynamicCache`` input ([batch, kv_heads, past, head_dim] per layer)."""
    import transformers as tf
    from transformers.integrations.executorch import register_dynamic_cache_export_support
    register_dynamic_cache_export_support()
    cache = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (3, 7)), past_key_values=cache, use_cache=True)
    batch, past = Dim("batch", min=1, max=256), Dim("past", min=2, max=2046)
    per_layer = [{0: batch, 2: past}] * len(cache.layers)
    return torch.export.export(DecodeStep(model), (), {"input_ids": torch.randint(0, VOCAB, (3, 2)),
                                                       "past_key_values": cache},
                               dynamic_shapes={"input_ids": {0: batch, 1: Dim("seq", min=1, max=2048)},
                                               "past_key_values": [per_layer, per_layer]}, strict=False)


def collected_setup(model: torch.nn.Module, steps: list[Any], db: str, decode_step: bool = False,
                    as_exported: bool = False) -> tuple[Any, dict[str, Any]]:
    """Export ``model`` (its decode step with the cache as inputs when ``decode_step``), collect every
    call ``steps`` price into ``db`` (as ``kernels collect`` does) and return the serving setup priced
    from it. ``as_exported``: the export's own ops (``python_locals=False``: transformers' grouped-mm fallback
    kept, as before passes/eager_grouped_mm.py), for a before/after comparison."""
    from boomfx.frontend.capture import capture
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.serving.collect import collect_serving
    from boomfx.serving.serve import setup
    from boomfx.serving.steps import KV_WRITE_CONCAT
    spec = cpu_spec()
    program = capture(export_decode_step(model) if decode_step else export(model),
                      options=ProgramOptions(target_kind="cpu", python_locals=not as_exported))
    opts = dict(max_model_len=2047 if decode_step else 2048, max_num_seqs=64, max_num_batched_tokens=2048)
    plain = setup(program, spec, db="none", **opts)
    # what `boomfx serve --device cpu --collect --kv-write concat` runs (boomfx/serving/collect.py)
    # (its own calibration of transformers' Python: calibrate_host_overhead, on the databases' clock)
    collected = collect_serving(plain.pricer(kv_write=KV_WRITE_CONCAT), steps, Path(db), spec)
    info = {"measured": collected.measured, "present": collected.present, "failed": collected.failed,
            "seconds": round(collected.seconds, 1),
            "clock": "thread" if torch.get_num_threads() == 1 else "wall"}   # kernels_db.measure.protocol_measurer
    return setup(program, spec, db=db, **opts), info


def calibrate_host_overhead(iters: int, tmp: str) -> tuple[Any, list[dict[str, Any]]]:
    """transformers' Python per module call on this host, as ``boomfx serve --collect --kv-write concat``
    measures it (boomfx/serving/host_overhead.py: calibration Llamas of 1 and 3 layers, not benchmark
    models), on the clock the databases use."""
    from boomfx.serving.host_overhead import CALIBRATION_ITERS, measure_module_call_ns
    from boomfx.serving.steps import HostOverhead
    clock = "thread" if torch.get_num_threads() == 1 else "wall"
    per_call, rows = measure_module_call_ns(Path(tmp), max(iters, CALIBRATION_ITERS), clock)
    return HostOverhead(0.0, per_call, "transformers Python per module call, measured here (calibration Llamas)"), rows


def run_model(name: str, iters: int, db: str, overhead: Any, as_exported: bool = False) -> dict[str, Any]:
    from boomfx.serving.steps import KV_WRITE_CONCAT, Step
    model = build(name)
    one = keeps_one_logit(model)
    points = [("prefill", 1, p, Step((), ((p, p),), sampled=1 if one else p)) for p in PREFILL_LENS]
    points += [("decode", b, c, Step((c,) * b)) for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
    s, collected = collected_setup(model, [st for *_, st in points], db, as_exported=as_exported)
    clock = collected["clock"]
    pricer = s.pricer(kv_write=KV_WRITE_CONCAT, host_overhead=overhead)
    rows = []
    for kind, b, n, st in points:
        pred = pricer.step_time(st)
        wall, cpu = real_prefill(model, n, iters) if kind == "prefill" else real_decode(model, b, n, iters)
        real = cpu if clock == "thread" else wall     # the clock the database was measured with
        rows.append({"model": name, "kind": kind, "batch": b, "tokens" if kind == "prefill" else "context": n,
                     "pred_s": pred.total_ns / 1e9, "real_s": real, "real_wall_s": wall, "real_cpu_s": cpu,
                     "clock": clock, "err": pred.total_ns / 1e9 / real - 1.0,
                     "err_wall": pred.total_ns / 1e9 / wall - 1.0,
                     "err_without_host_overhead": (pred.total_ns - pred.parts["host_overhead"].device_ns) / 1e9 / real
                     - 1.0,
                     "parts_s": {k: v.device_ns / 1e9 for k, v in pred.parts.items()},
                     "sources": sorted({x for v in pred.parts.values() for x in v.sources})})
    kv = []
    for b, tokens in ((1, 100), (3, 257)):
        real = real_cache_bytes(model, b, tokens)
        planned = s.plan.kv_bytes_per_token * b * tokens
        kv.append({"model": name, "batch": b, "tokens": tokens, "real_bytes": real, "plan_bytes": planned,
                   "equal": real == planned})
    site = s.model.uniform_site()
    return {"rows": rows, "kv": kv, "collect": collected,
            "facts": {"layers": s.model.num_layers, "module_calls": s.model.module_calls, "q_heads": site.q_heads, "kv_heads": site.kv_heads,
                      "head_dim": site.head_dim, "kv_bytes_per_token": s.plan.kv_bytes_per_token}}


def run_cache_export(name: str, iters: int, db: str, overhead: Any) -> list[dict[str, Any]]:
    """Decode steps priced from the model's decode-step export (the graph itself) vs real steps."""
    from boomfx.serving.steps import KV_WRITE_CONCAT, Step
    model = build(name)
    points = [(b, c, Step((c,) * b)) for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
    s, collected = collected_setup(model, [st for *_, st in points], db, decode_step=True)
    pricer = s.pricer(kv_write=KV_WRITE_CONCAT, host_overhead=overhead)
    assert pricer.decode_from_graph, name
    rows = []
    for b, c, st in points:
        pred = pricer.step_time(st)
        wall, cpu = real_decode(model, b, c, iters)
        real = cpu if collected["clock"] == "thread" else wall
        rows.append({"model": name, "export": "decode step with cache inputs", "kind": "decode", "batch": b,
                     "context": c, "pred_s": pred.total_ns / 1e9, "real_s": real, "real_wall_s": wall,
                     "real_cpu_s": cpu, "clock": collected["clock"], "err": pred.total_ns / 1e9 / real - 1.0,
                     "err_without_host_overhead": (pred.total_ns - pred.parts["host_overhead"].device_ns) / 1e9
                     / real - 1.0,
                     "parts_s": {k: v.device_ns / 1e9 for k, v in pred.parts.items()},
                     "kv_bytes_per_token": s.plan.kv_bytes_per_token})
    return rows


def simulation_speed() -> list[dict[str, Any]]:
    """Wall time of 10,000-request simulations (pricing included) of the Llama model on an H100."""
    from boomfx.frontend.capture import capture
    from boomfx.core.devices import get_device
    from boomfx.core.program import ProgramOptions
    from boomfx.serving.serve import run_workload, setup
    from boomfx.serving.workload import Workload
    device = get_device("h100-80gb")
    program = capture(export(build("llama")), options=ProgramOptions(target_kind="cuda"))
    s = setup(program, device, db="none", max_model_len=2048)
    out = []
    for rate in (20.0, 200.0, 2000.0, 20000.0):
        wl = Workload(10_000, 512, 128, request_rate=rate, seed=0)
        t0 = time.perf_counter()
        rep = run_workload(s, wl, find_max_rate=False)
        out.append({"requests": 10_000, "rate": rate, "seconds": time.perf_counter() - t0, "steps": rep.steps,
                    "sustainable": rep.sustainable, "ttft_p50_ms": rep.ttft.p50_ns / 1e6,
                    "tpot_p50_ms": rep.tpot.p50_ns / 1e6, "output_tokens_per_s": rep.output_tokens_per_s,
                    "loadavg": os.getloadavg()})
    return out


def write(results: dict[str, Any], stem: str = "serving_cpu") -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    rows = results["rows"]
    lines = ["# boomfx serve --device cpu vs real transformers steps with a DynamicCache", "",
             f"{results['meta']['cpu']}, torch {results['meta']['torch']}, transformers "
             f"{results['meta']['transformers']}, {results['meta']['threads']} intra-op thread(s), clock "
             f"{(results['rows'] or results.get('cache_export_rows') or [{'clock': '?'}])[0]['clock']} (the database's; wall error also in the JSON), median "
             f"of {results['meta']['iters']} steps after 2 warm-ups; {results['meta']['date']}. Load average at start "
             f"{results['meta']['loadavg_start']}, at end {results['meta']['loadavg_end']} (shared machine).",
             ""]
    ho = results["meta"]["host_overhead"]
    lines += [f"Host overhead per step (transformers' Python outside the kernels), measured on calibration "
              f"Llamas of {', '.join(str(c['layers']) for c in ho['calibration'])} layers (not the benchmark "
              f"models): {ho['per_module_call_ns'] / 1e3:.1f} us per module call. Errors without it are in the "
              "JSON (err_without_host_overhead)."]
    if rows:
        lines += _plain_lines(results)
    if results.get("cache_export_rows"):
        lines += ["", "Decode steps priced from the decode-step export that carries a DynamicCache (the graph's own "
                      "attention over the cached context and torch.cat cache writes), vs the same real steps:", "",
                  "| model | batch | context | predicted | real | error | error without host overhead |",
                  "|---|---|---|---|---|---|---|"]
        for r in results["cache_export_rows"]:
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {1e3 * r['pred_s']:.2f} ms | "
                         f"{1e3 * r['real_s']:.2f} ms | {100 * r['err']:+.1f}% | "
                         f"{100 * r['err_without_host_overhead']:+.1f}% |")
        errs = [abs(r["err"]) for r in results["cache_export_rows"]]
        lines += ["", f"Decode-step exports (|error|): median {100 * statistics.median(errs):.1f}%, worst "
                      f"{100 * max(errs):.1f}%. The export runs work eager transformers skips for a one-token step "
                      "without padding: its mask is built (symbolic shapes cannot take the mask-free path) and "
                      "K/V are GQA-expanded by copies (transformers' `use_gqa_in_sdpa` needs no mask); both grow "
                      "with batch x context. The copies that rebuild the DynamicCache from its flattened inputs "
                      "(cat of an empty tensor) are left out of the prediction."]
    if results.get("simulation"):
        lines += ["", "10,000-request simulations (Llama model on h100-80gb, 512 + 128 tokens, pricing included):", "",
                  "| rate (req/s) | seconds | steps | sustainable | TTFT p50 | TPOT p50 | load avg |",
                  "|---|---|---|---|---|---|---|"]
        for x in results["simulation"]:
            lines.append(f"| {x['rate']:g} | {x['seconds']:.2f} | {x['steps']} | {x['sustainable']} | "
                         f"{x['ttft_p50_ms']:.2f} ms | {x['tpot_p50_ms']:.3f} ms | "
                         f"{', '.join(f'{v:.1f}' for v in x['loadavg'])} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")


def _plain_lines(results: dict[str, Any]) -> list[str]:
    """The plain exports' rows, summary, KV bytes and simulations."""
    lines = ["", "| model | step | batch | tokens / context | predicted | real | error | error without host overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:  # price sources per row are in the JSON
        size = r.get("tokens", r.get("context"))
        lines.append(f"| {r['model']} | {r['kind']} | {r['batch']} | {size} | {1e3 * r['pred_s']:.2f} ms | "
                     f"{1e3 * r['real_s']:.2f} ms | {100 * r['err']:+.1f}% | {100 * r['err_without_host_overhead']:+.1f}% |")
    lines += ["", "Module calls per forward: " + ", ".join(f"{m} {v['facts']['module_calls']}"
                                                         for m, v in results["models"].items()) + "."]
    lines += ["", "Summary (|error|): " + "; ".join(
        f"{m}: median {100 * v['median']:.1f}%, worst {100 * v['worst']:.1f}%" for m, v in results["summary"].items()),
        "", "KV-cache bytes of the real DynamicCache tensors after a prefill vs the plan "
            "(2 x layers x KV heads x head dim x dtype bytes x tokens):", "",
        "| model | batch | tokens | real bytes | plan bytes | equal |", "|---|---|---|---|---|---|"]
    for k in results["kv"]:
        lines.append(f"| {k['model']} | {k['batch']} | {k['tokens']} | {k['real_bytes']} | {k['plan_bytes']} | "
                     f"{'yes' if k['equal'] else 'NO'} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--no-simulation", action="store_true")
    ap.add_argument("--cache-export", default="", metavar="MODELS",
                    help="also price decode steps from these models' decode-step exports (e.g. llama,qwen2moe)")
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the plain exports (with --cache-export; writes serving_cpu_decode_export.*)")
    ap.add_argument("--out", default="", help="results file stem (default serving_cpu, or serving_cpu_decode_export "
                                              "with --no-plain)")
    ap.add_argument("--as-exported", action="store_true",
                    help="price the export's own ops (transformers' grouped-mm fallback kept): the pricing before "
                         "passes/eager_grouped_mm.py, for comparison")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default: torch's); 1 on a shared host: timed by this thread's CPU time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    meta = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(), "iters": args.iters,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg_start": os.getloadavg(),
            "command": " ".join(sys.argv)}
    rows, kv, per_model, cache_rows = [], [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        overhead, calibration = calibrate_host_overhead(args.iters, tmp)
        print(f"host overhead: {overhead.per_module_call_ns / 1e3:.1f} us per module call", flush=True)
        for name in filter(None, args.cache_export.split(",")):
            cache_rows += run_cache_export(name, args.iters, str(Path(tmp) / f"{name}-decode.sqlite"), overhead)
            for r in cache_rows[-len(DECODE_BATCHES) * len(DECODE_CONTEXTS):]:
                print(f"{name:9} decode-step export b={r['batch']:<3} {r['context']:>5}  pred {1e3 * r['pred_s']:8.2f} ms"
                      f"  real {1e3 * r['real_s']:8.2f} ms  {100 * r['err']:+6.1f}%", flush=True)
        for name in ([] if args.no_plain else args.models.split(",")):
            res = run_model(name, args.iters, str(Path(tmp) / f"{name}.sqlite"), overhead, args.as_exported)
            rows += res["rows"]
            kv += res["kv"]
            per_model[name] = {"collect": res["collect"], "facts": res["facts"]}
            for r in res["rows"]:
                print(f"{name:9} {r['kind']:8} b={r['batch']:<3} {r.get('tokens', r.get('context')):>5}  pred "
                      f"{1e3 * r['pred_s']:8.2f} ms  real {1e3 * r['real_s']:8.2f} ms  {100 * r['err']:+6.1f}%", flush=True)
    summary: dict[str, Any] = {}
    for name in per_model:
        errs = [abs(r["err"]) for r in rows if r["model"] == name]
        summary[name] = {"median": statistics.median(errs), "worst": max(errs)}
    errs = [abs(r["err"]) for r in rows]
    if errs:
        summary["all"] = {"median": statistics.median(errs), "worst": max(errs)}
    simulation = [] if args.no_simulation else simulation_speed()
    meta["loadavg_end"] = os.getloadavg()
    meta["host_overhead"] = {"per_module_call_ns": overhead.per_module_call_ns,
                             "calibration": calibration}
    write({"meta": meta, "summary": summary, "models": per_model, "rows": rows, "kv": kv, "simulation": simulation,
           "cache_export_rows": cache_rows}, stem=args.out or ("serving_cpu_decode_export" if args.no_plain else "serving_cpu"))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
