"""Time ``torch.export.load`` against ``boomfx.frontend.loader.load_program`` on Llama-70B-shaped exports.

Why: the analyzer must answer in seconds, and torch's loader spends most of its time re-parsing
symbolic shape strings. This script records how much the boomfx loader saves.

Exports are built on the meta device (no weight data) and cached, because exporting an 80-layer
model takes minutes while loading is what we measure. Each timing runs in a fresh subprocess so
neither loader profits from caches (sympy, operator lookup) warmed by the other.

Usage::

    python benchmarks/load_speed.py                 # 8 and 32 layers
    python benchmarks/load_speed.py --layers 8 32 80 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "boomfx_load_speed_cache"

# Llama-2-70B shapes; only the layer count varies.
LLAMA_70B_SHAPE = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}


def export_llama(num_layers: int, path: Path) -> None:
    """Export a meta-device Llama of ``num_layers`` layers to ``path`` (dynamic batch and seq)."""
    import torch
    from torch.export import Dim
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=num_layers, use_cache=False, **LLAMA_70B_SHAPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    input_ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    dynamic_shapes = {"input_ids": {0: Dim("batch"), 1: Dim("seq", min=2)}}
    ep = torch.export.export(
        model, (), {"input_ids": input_ids}, dynamic_shapes=dynamic_shapes, strict=False
    )
    tmp = path.with_suffix(".tmp.pt2")
    torch.export.save(ep, tmp)
    os.replace(tmp, path)


def cached_export(num_layers: int, cache_dir: Path) -> Path:
    """Return the cached export for ``num_layers``, exporting it in a subprocess if missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"llama70b_shape_{num_layers}l.pt2"
    if not path.exists():
        print(f"exporting {num_layers}-layer model to {path} ...", flush=True)
        code = (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "import load_speed; load_speed.export_llama(int(sys.argv[1]), Path(sys.argv[2]))"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(num_layers), str(path), str(Path(__file__).parent)],
            check=True,
        )
    return path


# Runs in a fresh interpreter: import torch first so that import time is not counted.
_TIMER = """
import sys, time, json
import torch
which, path = sys.argv[1], sys.argv[2]
if which == "boomfx":
    from boomfx.frontend.loader import load_program
    import transformers.modeling_outputs  # noqa: F401  same imports as the torch run, for a fair comparison
    start, cpu_start = time.perf_counter(), time.process_time()
    ep = load_program(path)
else:
    import transformers.modeling_outputs  # noqa: F401  torch.export.load needs the pytree classes registered
    start, cpu_start = time.perf_counter(), time.process_time()
    ep = torch.export.load(path)
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu, "nodes": len(ep.graph.nodes)}))
"""


def time_load(which: str, path: Path) -> dict:
    """Time one load of ``path`` with ``which`` ('torch' or 'boomfx') in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _TIMER, which, str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(layers: list[int], repeats: int, cache_dir: Path) -> list[dict]:
    """Measure both loaders ``repeats`` times per layer count; return one row per layer count."""
    rows = []
    for num_layers in layers:
        path = cached_export(num_layers, cache_dir)
        torch_s, boomfx_s, torch_cpu_s, boomfx_cpu_s, nodes = [], [], [], [], None
        for _ in range(repeats):
            torch_run = time_load("torch", path)
            boomfx_run = time_load("boomfx", path)
            torch_s.append(torch_run["seconds"])
            boomfx_s.append(boomfx_run["seconds"])
            torch_cpu_s.append(torch_run["cpu_seconds"])
            boomfx_cpu_s.append(boomfx_run["cpu_seconds"])
            if torch_run["nodes"] != boomfx_run["nodes"]:
                raise RuntimeError(f"node count differs: {torch_run} vs {boomfx_run}")
            nodes = torch_run["nodes"]
        row = {
            "layers": num_layers,
            "file_bytes": path.stat().st_size,
            "nodes": nodes,
            "torch_load_s": statistics.median(torch_s),
            "boomfx_load_s": statistics.median(boomfx_s),
            "torch_load_cpu_s": statistics.median(torch_cpu_s),
            "boomfx_load_cpu_s": statistics.median(boomfx_cpu_s),
            "torch_load_all_s": torch_s,
            "boomfx_load_all_s": boomfx_s,
        }
        row["speedup"] = row["torch_load_s"] / row["boomfx_load_s"]
        row["speedup_cpu"] = row["torch_load_cpu_s"] / row["boomfx_load_cpu_s"]
        print(
            f"{num_layers:3d} layers: torch {row['torch_load_s']:.2f} s, "
            f"boomfx {row['boomfx_load_s']:.2f} s, {row['speedup']:.1f}x wall, "
            f"{row['speedup_cpu']:.1f}x CPU time",
            flush=True,
        )
        rows.append(row)
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    """Render the results as a markdown table with the conditions of the run."""
    lines = [
        "# Load speed: torch.export.load vs boomfx.frontend.loader.load_program",
        "",
        f"Llama-70B-shaped exports on meta (hidden 8192, MLP 28672, 64 heads, 8 KV heads, vocab 32000), "
        f"median of {meta['repeats']} fresh-process loads each; torch {meta['torch']}, "
        f"{meta['cpu_count']} CPUs, {meta['platform']}. The machine is shared: wall times vary with other "
        f"load (1-min load average at the end: {meta['load_average_1m']:.1f}); CPU time (process_time) is steadier.",
        "",
        "| layers | file MiB | nodes | torch.export.load s (CPU s) | boomfx load_program s (CPU s) | speedup wall | speedup CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['file_bytes'] / 2**20:.1f} | {r['nodes']} | "
            f"{r['torch_load_s']:.2f} ({r['torch_load_cpu_s']:.2f}) | {r['boomfx_load_s']:.2f} "
            f"({r['boomfx_load_cpu_s']:.2f}) | {r['speedup']:.1f}x | {r['speedup_cpu']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--export-only", action="store_true", help="only build the cached exports")
    args = parser.parse_args()
    if args.export_only:
        for num_layers in args.layers:
            print(cached_export(num_layers, args.cache_dir))
        return

    import torch

    rows = run(args.layers, args.repeats, args.cache_dir)
    meta = {
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_1m": os.getloadavg()[0],
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "load_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS_DIR / "load_speed.md").write_text(to_markdown(rows, meta))
    print(f"wrote {RESULTS_DIR / 'load_speed.json'} and {RESULTS_DIR / 'load_speed.md'}")


if __name__ == "__main__":
    main()
