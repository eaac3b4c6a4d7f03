"""Peak memory, eager and compiled, on architectures that no test, benchmark or design session used.

Why: the memory mechanisms of compiled training (``passes/partitioner.py``, ``passes/buffer_reuse.py``, ...)
were worked out reading Inductor's output code on the models of ``benchmarks/compiled_memory.py``. This
suite is the check a new user would make: other ``transformers`` architectures from small configs (tied
Llama, Gemma, Phi, Falcon, BLOOM, GPT-2, ELECTRA, ALBERT, BART, ViT, ConvNeXt V2, RegNet), training (AdamW,
the export's loss: cross-entropy for the causal LMs, mean otherwise) and inference, eager and
``torch.compile``. Each case runs ``boomfx.validate(FILE, db="none", threads=1, repeats=1, warmup=0)`` in a
fresh process: the predicted peak above the step's start against the profiler peak of the real step
(memory does not depend on the clock or the database's times).

Run: ``python benchmarks/heldout_memory.py [--models gpt2,phi] [--modes train] [--exec compiled]``; writes
``benchmarks/results/heldout_memory.{json,md}`` (``--render``: rewrite them from the json's rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from broad_cpu_accuracy import _no_dropout  # noqa: E402  (no dropout, no KV cache: the same configs)

RESULTS = ROOT / "benchmarks" / "results"
BATCH, SEQ, VOCAB, IMAGE_BATCH = 4, 128, 2048, 8
MODELS = ("llama_tied", "gemma", "phi", "falcon", "bloom", "gpt2", "electra", "albert", "bart", "vit", "convnextv2",
          "regnet")
CAUSAL = ("llama_tied", "gemma", "phi", "falcon", "bloom", "gpt2")

_ONE = """
import json, sys
sys.path.insert(0, sys.argv[5])
from pathlib import Path
from heldout_memory import export_file
from boomfx.validate import validate
name, mode, ex = sys.argv[1], sys.argv[2], sys.argv[3]
path = export_file(name, mode == "train", Path(sys.argv[4]))
r = validate(str(path), train=mode == "train", compile=ex == "compiled", db="none", threads=1, repeats=1, warmup=0,
             device="cpu")
print(json.dumps({"pred": r.predicted_peak_above_start_bytes, "real": r.measured_peak_above_start_bytes,
                  "err": r.memory_error, "loss": r.options.get("loss")}))
"""


def build(name: str) -> tuple[Any, dict[str, Any]]:
    """The model (random weights, small config) and its keyword inputs."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    common = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=VOCAB)
    text = {"input_ids": ids}
    if name == "llama_tied":     # GQA 2:1, tied output head
        return tf.LlamaForCausalLM(_no_dropout(tf.LlamaConfig(**common, intermediate_size=688, num_key_value_heads=2,
                                                         tie_word_embeddings=True))), text
    if name == "gemma":          # MQA, GeGLU (tanh GELU), scaled embedding, tied head
        return tf.GemmaForCausalLM(_no_dropout(tf.GemmaConfig(**common, intermediate_size=512, num_key_value_heads=1,
                                                         head_dim=64))), text
    if name == "phi":            # parallel-free decoder, partial rotary, GELU-tanh MLP written out
        return tf.PhiForCausalLM(_no_dropout(tf.PhiConfig(**common, intermediate_size=1024))), text
    if name == "falcon":         # MQA, parallel attention + MLP
        return tf.FalconForCausalLM(_no_dropout(tf.FalconConfig(**common, new_decoder_architecture=False,
                                                           multi_query=True))), text
    if name == "bloom":          # ALiBi, GELU-tanh written out
        cfg = tf.BloomConfig(n_layer=2, hidden_size=256, n_head=4, vocab_size=VOCAB)
        return tf.BloomForCausalLM(_no_dropout(cfg)), text
    if name == "gpt2":           # Conv1D projections, GELU-tanh written out, tied head
        return tf.GPT2LMHeadModel(_no_dropout(tf.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=VOCAB,
                                                       n_positions=512))), text
    if name == "electra":        # factorised embedding (128 -> 256)
        cfg = tf.ElectraConfig(**common, intermediate_size=1024, embedding_size=128)
        return tf.ElectraModel(_no_dropout(cfg)), text
    if name == "albert":         # one layer's weights shared by both layers
        return tf.AlbertModel(_no_dropout(tf.AlbertConfig(**common, intermediate_size=1024, embedding_size=128)),
                              add_pooling_layer=False), text
    if name == "bart":           # encoder-decoder, learned positions
        cfg = tf.BartConfig(encoder_layers=2, decoder_layers=2, d_model=256, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, vocab_size=VOCAB)
        return tf.BartModel(_no_dropout(cfg)), {"input_ids": ids, "decoder_input_ids": ids[:, :SEQ // 2]}
    pixels = {"pixel_values": torch.randn(IMAGE_BATCH, 3, 64, 64)}
    if name == "vit":
        return tf.ViTModel(_no_dropout(tf.ViTConfig(image_size=64, patch_size=8, num_hidden_layers=2, hidden_size=256,
                                               num_attention_heads=4, intermediate_size=1024)),
                           add_pooling_layer=False), pixels
    if name == "convnextv2":     # global response normalisation
        return tf.ConvNextV2Model(_no_dropout(tf.ConvNextV2Config(image_size=64, hidden_sizes=[32, 64, 128, 256],
                                                             depths=[1, 1, 2, 1]))), pixels
    if name == "regnet":         # grouped convolutions, squeeze-and-excitation
        return tf.RegNetModel(_no_dropout(tf.RegNetConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                                                     groups_width=16))), pixels
    raise KeyError(name)


def export_file(name: str, train: bool, directory: Path) -> Path:
    import torch
    path = directory / f"{name}-{'train' if train else 'infer'}.pt2"
    if not path.exists():
        model, kwargs = build(name)
        model.train(train)
        torch.export.save(torch.export.export(model, (), kwargs, strict=False), str(path))
    return path


def run_case(name: str, mode: str, ex: str, directory: Path, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "mode": mode, "exec": ex}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _ONE, name, mode, ex, str(directory), str(ROOT / "benchmarks")],
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        row["error"] = f"did not finish in {timeout_s:.0f} s"
        return row
    row["seconds"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()] or [f"exit {proc.returncode}"]
        row["error"] = lines[-1][:200]
        return row
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _stats(values: list[float]) -> str:
    if not values:
        return "| 0 | - | - | - |"
    return (f"| {len(values)} | {_pct(statistics.median(abs(v) for v in values))} | "
            f"{_pct(max(values, key=abs))} | {_pct(statistics.fmean(values))} |")


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "heldout_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Peak memory on held-out architectures", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}; {meta['date']}; `{meta['command']}`. "
             "Predicted peak above the step's start (no database) vs the profiler peak of the real step "
             "(`boomfx.validate`, one thread, a fresh process per case). No test, benchmark or design session "
             "used these models before this file was written (2026-12-05); the compiled rows' changes that day "
             "(below) were made reading three of them, so those are no longer held out.", "",
             "| model | mode | exec | loss | predicted | real | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['exec']} | - | - | - | failed: {r['error']} |")
            continue
        lines.append(f"| {r['model']} | {r['mode']} | {r['exec']} | {r.get('loss') or '-'} | "
                     f"{r['pred'] / 2**20:.2f} MiB | {r['real'] / 2**20:.2f} MiB | {_pct(r['err'])} |")
    lines += ["", "| cases | n | median abs | worst | mean signed |", "|---|---|---|---|---|"]
    for ex in ("eager", "compiled"):
        for mode in ("train", "inference"):
            errs = [r["err"] for r in rows if r["exec"] == ex and r["mode"] == mode and isinstance(r.get("err"), float)]
            lines.append(f"| {ex} {mode} " + _stats(errs))
    lines += ["", "## Notes", "", *meta.get("notes", [])]
    (RESULTS / "heldout_memory.md").write_text("\n".join(lines) + "\n")


NOTES = [
    "- First run (2026-12-05, with Inductor's buffer pool, before the partitioner changes below): eager exact on "
    "every case (|error| <= 1.4%, RegNet training); compiled training GPT-2 +16.9%, Phi +16.6%, BLOOM +17.3%, "
    "ConvNeXt V2 +20.7%, ALBERT +5.9%, Gemma -6.0%, tied Llama -2.9%.",
    "- ConvNeXt V2 (+20.7% -> +0.1%): the global response norm's `x * Nx` was saved where AOTAutograd's min-cut "
    "partitioner recomputes it in the backward from the saved MLP input and per-image statistics; our model of the "
    "partitioner only followed recomputation chains inside one fusion group, and a reduction (the norm) splits "
    "the block into three (passes/partitioner.py: any generated group's pointwise values now).",
    "- GPT-2, Phi, BLOOM (+17% -> +0.5%, -1.0%, +1.9%): transformers writes their tanh GELU out as pointwise ops, and "
    "eager autograd saves a `detach` of the tanh output for its backward; the min-cut sees through it and "
    "recomputes the tanh from the saved MLP input, our model stopped at any forward view "
    "(passes/partitioner.py `_ALIASES`).",
    "- ALBERT compiled training went from +5.9% to -4.6% with the same changes (one layer's weights used by both "
    "layers; not analysed further).",
    "- Open: Gemma compiled training -6.0% (the forward's saved set matches within 0.2 MB; the real backward is "
    "1.5 MB higher at the first attention backward; Inductor keeps its traced order there, and our reordering "
    "is not the cause); BLOOM compiled inference -10.2% and BART's -13.3% (under: a buffer Inductor holds or makes "
    "that we do not; not analysed); ViT compiled inference -4.2% (as DeiT's -4.3% in "
    "compiled_memory.md); tied Llama compiled training -2.9%.",
    "- 2026-12-07 (session 43; rerun of every row, held out from that session's rules, which were read on Falcon, "
    "Phi-3 and Qwen2 of compiled_memory.md): compiled training Gemma -6.0% -> -3.4%, Phi -1.0% -> +0.1%, ViT +0.7% "
    "-> +0.0%, but BLOOM +1.9% -> +3.9%, Falcon +1.8% -> +3.1%, GPT-2 +0.5% -> +1.6%, ALBERT -4.6% -> -5.7%, tied "
    "Llama -2.9% -> -3.5%; BART -0.0% -> -1.2% (its real peak moved). 12 rows: median |error| 1.4% -> 1.4%, "
    "worst 6.0% -> 5.7%, mean signed -1.0% -> -0.4%. For GPT-2 and BLOOM the rule that saves the embedding output "
    "(partitioner.recomputable) is the +1-2%: GPT-2's forward saved set now matches Inductor's within 128 KiB "
    "(the position embedding), so its excess (+400 KiB at the first backward mm's) is in our backward. Every "
    "other row unchanged (eager and inference: the CPU flash attention's scratch does not reach their peaks).",
    "- 2026-12-07 (session 44; compiled rows rerun, `--exec compiled`, eager rows kept from 16:42): three mechanisms "
    "read in Inductor's output code of BART and BLOOM inference. (1) A compiled CPU graph runs the composite SDPA as "
    "the dispatcher decomposes it: a boolean mask becomes a stored `where(mask, 0, -inf)` of the batch-expanded "
    "shape, and the flash kernel returns a log-sum-exp (passes/cpu_sdpa.py). (2) A storage written over in place by a "
    "chain of kernels (a residual stream) was pooled at a middle link's death and handed to a new output while the "
    "chain still held it: BART's decoder got its key and value projections in one buffer (passes/buffer_reuse.py). "
    "(3) Inductor's inference-only `reorder_for_locality` makes each value right before its first consumer, and its "
    "horizontal fusion needs shared data, so BLOOM's value copy runs after the softmax and its fused projection "
    "stays alive through the scores (passes/locality_order.py, fusion rule 5). Compiled inference BART -13.3% -> "
    "-0.1%, BLOOM -10.2% -> -0.2%, ViT -4.2% -> -0.1% (held out: the flash kernel's scratch and log-sum-exp); every "
    "training row as before (Falcon inference -2.7% and ALBERT training -5.7% open).",
    "- 2026-12-07 (session 45; every row rerun, 22:26-22:32 UTC; nothing read on these models): Inductor's in-place "
    "rules (a reduction the output depends on does not block writing over an input; an input read on the way to "
    "another output does; a multi-output kernel's output is a buffer like any other), the ConcatKernel "
    "(passes/concat_into.py), Inductor's `cat` decomposition (passes/empty_cat.py) and the CPU flash attention "
    "backward's gradient copy made only for a heads-major gradient (kernels_db/cpu_attention_scratch.py). Compiled "
    "training: tied Llama -3.5% -> +0.3%, Gemma -3.4% -> -0.9%, Falcon +3.1% -> +0.8%; 12 rows: median |error| "
    "1.4% -> 0.6%, worst 5.7% (ALBERT, unchanged; BLOOM +3.9% unchanged), mean signed -0.4% -> -0.1%. Every eager "
    "and inference row unchanged (compiled inference worst Falcon -2.7%).",
]


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="train,inference")
    ap.add_argument("--exec", default="eager,compiled")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--render", action="store_true", help="rewrite the results from heldout_memory.json's rows")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads((RESULTS / "heldout_memory.json").read_text())
        saved["meta"]["notes"] = NOTES
        write_results(saved["rows"], saved["meta"])
        return 0
    directory = Path(tempfile.mkdtemp(prefix="boomfx_heldout_"))
    rows = []
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/heldout_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "notes": NOTES}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            for ex in [e.strip() for e in args.exec.split(",") if e.strip()]:
                row = run_case(name, mode, ex, directory, args.timeout_s)
                rows.append(row)
                print(f"{name} {mode} {ex}: {_pct(row.get('err')) if 'err' in row else row.get('error')}", flush=True)
                write_results(rows, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
