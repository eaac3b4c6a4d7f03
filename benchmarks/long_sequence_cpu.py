"""Long-sequence eager inference on this CPU: ``boomfx analyze --device cpu`` against the real ``nn.Module``.

Why: transformers attends differently while traced (an explicit causal mask, KV heads repeated) than
eagerly (``is_causal``, GQA); ``passes/eager_sdpa.py`` prices what the eager module calls. Its effect
grows with the sequence (the masked kernel computes every score), so this benchmark runs decoders at
1024 and 2048 tokens, one sequence, and reports both predictions: the default one (the module's calls)
and ``--no-python-locals`` (the export's own calls, the pricing before that pass; it also keeps the
graph's frees, which moves memory, not time).

Protocol (the user's): ``boomfx kernels collect --device cpu --for FILE --batch 1 --seq S`` for each of the
two programs into one database, ``boomfx analyze`` with it; the real step is ``model(input_ids)`` under
``no_grad`` at torch's default threads, wall clock, median of 7 after 2 warm-ups, half before and half
after the database.

Run: ``python benchmarks/long_sequence_cpu.py [--models llama,gpt2,qwen2] [--seqs 1024,2048]``; writes
``benchmarks/results/long_sequence_cpu.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
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
VOCAB = 4096


def build(name: str) -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, use_cache=False)
    if name == "llama":      # GQA 2:1
        cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=8192, **common)
        return tf.LlamaForCausalLM(cfg).eval()
    if name == "qwen2":      # GQA 4:1
        cfg = tf.Qwen2Config(num_hidden_layers=2, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                             num_key_value_heads=1, max_position_embeddings=8192, **common)
        return tf.Qwen2ForCausalLM(cfg).eval()
    if name == "gpt2":       # MHA: the mask alone
        cfg = tf.GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=8192, bos_token_id=0, eos_token_id=0,
                            **common)
        return tf.GPT2LMHeadModel(cfg).eval()
    # held out (added after the pass was written and measured on the three above)
    if name == "stablelm":   # MHA, partial rotary, LayerNorm
        cfg = tf.StableLmConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                                num_key_value_heads=4, max_position_embeddings=8192, **common)
        return tf.StableLmForCausalLM(cfg).eval()
    if name == "phi3":       # fused qkv, GQA 2:1
        cfg = tf.Phi3Config(num_hidden_layers=2, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=8192, pad_token_id=0, **common)
        return tf.Phi3ForCausalLM(cfg).eval()
    raise KeyError(name)


def real_ms(model: torch.nn.Module, seq: int, iters: int) -> list[float]:
    ids = torch.randint(0, VOCAB, (1, seq))
    out = []
    with torch.no_grad():
        for i in range(iters + 2):
            t0 = time.perf_counter()
            model(input_ids=ids)
            if i >= 2:
                out.append((time.perf_counter() - t0) * 1e3)
    return out


def predict(path: str, seq: int, db: str, graph: bool) -> dict[str, float]:
    from boomfx.cli.main import main as boomfx_main
    extra = ["--no-python-locals"] if graph else []
    sizes = ["--batch=1", f"--seq={seq}"]
    if boomfx_main(["kernels", "collect", "--device", "cpu", "--for", path, *sizes, *extra, "--db", db, "--quiet"]):
        raise RuntimeError("kernels collect failed")
    out = db + (".graph" if graph else ".eager") + ".json"
    if boomfx_main(["analyze", path, "--device", "cpu", *sizes, *extra, "--db", db, "--json", out]):
        raise RuntimeError("analyze failed")
    r = json.loads(Path(out).read_text())
    sdpa = sum(k["time_ns"] for k in r["kernels"] if "scaled_dot_product" in k["op"])
    return {"time_ms": r["time"]["total_ns"] / 1e6, "sdpa_ms": sdpa / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,gpt2,qwen2")
    ap.add_argument("--seqs", default="1024,2048")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--append", action="store_true", help="keep the results file's other rows (a row run now "
                                                           "replaces the same model and length)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="boomfx_longseq_")
    rows = []
    load_start = os.getloadavg()
    for name in args.models.split(","):
        model = build(name)
        ep = torch.export.export(model, (), {"input_ids": torch.randint(0, VOCAB, (2, 64))},
                                 dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=64),
                                                               1: Dim("seq", min=2, max=8191)}}, strict=False)
        path = str(Path(tmp) / f"{name}.pt2")
        torch.export.save(ep, path)
        for seq in (int(s) for s in args.seqs.split(",")):
            first = real_ms(model, seq, (args.iters + 1) // 2)
            db = str(Path(tmp) / f"{name}-{seq}.db")
            eager, graph = predict(path, seq, db, False), predict(path, seq, db, True)
            second = real_ms(model, seq, args.iters // 2)
            real = statistics.median(first + second)
            row = {"model": name, "seq": seq, "real_ms": real, "real_halves_ms": [statistics.median(first),
                                                                                   statistics.median(second)],
                   "eager": eager, "graph": graph,
                   "err_eager": eager["time_ms"] / real - 1, "err_graph": graph["time_ms"] / real - 1}
            rows.append(row)
            print(f"{name:6s} seq {seq:5d}: real {real:7.1f} ms; predicted {eager['time_ms']:7.1f} ms "
                  f"({row['err_eager']:+.1%}, SDPA {eager['sdpa_ms']:.1f}), as exported {graph['time_ms']:7.1f} ms "
                  f"({row['err_graph']:+.1%}, SDPA {graph['sdpa_ms']:.1f})", flush=True)
    command = "python benchmarks/long_sequence_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commands = [command]
    if args.append and (RESULTS / "long_sequence_cpu.json").exists():
        old = json.loads((RESULTS / "long_sequence_cpu.json").read_text())
        fresh = {(r["model"], r["seq"]) for r in rows}
        rows = [r for r in old["rows"] if (r["model"], r["seq"]) not in fresh] + rows
        commands = old["meta"].get("commands", [old["meta"]["command"]]) + commands
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_start": load_start, "load_end": os.getloadavg(), "command": "; ".join(commands),
            "commands": commands}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "long_sequence_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Long-sequence eager inference on this CPU", "",
             f"torch {meta['torch']}, {meta['threads']} threads (torch's default), {meta['date']} UTC; load "
             f"{meta['load_start'][0]:.1f} -> {meta['load_end'][0]:.1f} (last run). Commands, in order (a later "
             f"one replaces the rows it ran): `{meta['command']}`. Held out: stablelm, phi3 (added after the "
             "pass was written and measured on llama, gpt2, qwen2). "
             "Real: the nn.Module, one sequence, no_grad, wall clock, median of 7 (half before, half after the "
             "database). Predicted: `boomfx analyze --device cpu` with a database collected for it; 'as exported': "
             "`--no-python-locals` (the export's mask and repeated KV heads, as priced before passes/eager_sdpa.py).",
             "", "| model | seq | real | predicted | error | SDPA | as exported | error | SDPA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['seq']} | {r['real_ms']:.1f} ms | {r['eager']['time_ms']:.1f} ms | "
                     f"{r['err_eager']:+.1%} | {r['eager']['sdpa_ms']:.1f} ms | {r['graph']['time_ms']:.1f} ms | "
                     f"{r['err_graph']:+.1%} | {r['graph']['sdpa_ms']:.1f} ms |")
    errs = [abs(r["err_eager"]) for r in rows]
    before = [abs(r["err_graph"]) for r in rows]
    lines += ["", f"Median |error|: {statistics.median(errs):.1%} (as exported: {statistics.median(before):.1%}); "
              f"worst {max(errs):.1%} (as exported: {max(before):.1%})."]
    (RESULTS / "long_sequence_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
