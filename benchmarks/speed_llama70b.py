"""How fast is ``boomfx analyze`` on Llama-70B-shaped exports, against ``torch.export.load`` alone?

Targets (from the project plan):
  1. 80-layer ``analyze --train`` end to end <= 0.5x the time of ``torch.export.load`` of the same file;
  2. 80-layer analysis <= 2x the 8-layer analysis (cost must not grow with depth: repeated blocks are
     priced once);
  3. an 18-point sweep (batch x seq) <= 2x one single-point analysis.

Exports are built from ``transformers.LlamaConfig`` on the meta device (no weight data), with dynamic
batch and sequence, and cached under ``benchmarks/.cache/`` because the 80-layer export takes minutes.
Every timing runs in a fresh subprocess so no stage profits from caches warmed by another. A stage
that fails is recorded with its error; the script itself does not crash.

Usage::

    python benchmarks/speed_llama70b.py                  # 8 and 80 layers
    python benchmarks/speed_llama70b.py --layers 8       # quick run
    python benchmarks/speed_llama70b.py --export-only    # only build the cached exports

Writes ``benchmarks/results/speed_llama70b.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
CACHE_DIR = HERE / ".cache"

DEVICE = "h100-sxm"
BATCH, SEQ = 1, 2048
SWEEP = ("batch=1,2,4,8,16,32", "seq=1024,2048,4096")      # 6 x 3 = 18 points
STAGE_TIMEOUT_S = 1800


def cached_export(num_layers: int) -> tuple[Path, Optional[float]]:
    """The cached export for ``num_layers`` and the seconds it took to build it now (None: cached)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / f"llama70b_{num_layers}l.pt2"
    if path.exists():
        return path, None
    print(f"exporting {num_layers}-layer model to {path} ...", flush=True)
    # the export helper (Llama-2-70B shapes, only the layer count varies) is load_speed.py's
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "import load_speed as b; b.export_llama(int(sys.argv[1]), Path(sys.argv[2]))")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(num_layers), str(path), str(HERE)], check=True)
    return path, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------
# Stages: each one a fresh subprocess, timed from outside (end to end) or inside (load alone)
# ---------------------------------------------------------------------------------------------------
# torch.export.load needs the transformers pytree classes registered; import them before the clock.
_TORCH_LOAD = """
import sys, time, json
import torch
import transformers.modeling_outputs  # noqa: F401
start = time.perf_counter()
ep = torch.export.load(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - start, "nodes": len(ep.graph.nodes)}))
"""

# Block detection alone on the loaded inference graph (boomfx's own loader).
_BLOCKS = """
import sys, time, json
from boomfx.frontend.loader import load_program
from boomfx.frontend.capture import export_roles
from boomfx.core.program import Program
from boomfx.passes.blocks import block_pass
ep = load_program(sys.argv[1])
program = Program(ep.graph_module, {}, export_roles(ep))
start = time.perf_counter()
info = block_pass(program)
print(json.dumps({"seconds": time.perf_counter() - start, "method": info.method,
                  "classes": [[c.name, len(c.instances), c.nodes_per_instance] for c in info.classes]}))
"""


def _run(cmd: list[str], parse_json: bool = False) -> dict[str, Any]:
    """Run one stage; {"ok", "wall_s", ...}; a failure is recorded with the tail of its output."""
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {"ok": False, "wall_s": time.perf_counter() - start,
                "error": f"timed out after {STAGE_TIMEOUT_S} s"}
    except OSError as exc:
        return {"ok": False, "wall_s": time.perf_counter() - start, "error": repr(exc)}
    wall = time.perf_counter() - start
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"ok": False, "wall_s": wall, "error": f"exit {out.returncode}: " + " | ".join(tail)}
    row: dict[str, Any] = {"ok": True, "wall_s": wall}
    if parse_json:
        try:
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError) as exc:
            return {"ok": False, "wall_s": wall, "error": f"unreadable output: {exc}"}
    return row


def _analyze(path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "boomfx.cli.main", "analyze", str(path), "--device", DEVICE, *extra]


def measure(num_layers: int) -> dict[str, Any]:
    """Every stage for one layer count."""
    row: dict[str, Any] = {"layers": num_layers}
    try:
        path, export_s = cached_export(num_layers)
    except Exception as exc:  # noqa: BLE001 - recorded, not raised
        row["export"] = {"ok": False, "error": repr(exc)}
        return row
    row["export"] = {"ok": True, "seconds": export_s, "cached": export_s is None,
                     "file_bytes": path.stat().st_size}
    point = ("--batch", str(BATCH), "--seq", str(SEQ))
    stages = {
        "torch_export_load": ([sys.executable, "-c", _TORCH_LOAD, str(path)], True),
        "block_pass": ([sys.executable, "-c", _BLOCKS, str(path)], True),
        "analyze": (_analyze(path, *point), False),
        "analyze_train": (_analyze(path, *point, "--train"), False),
        "sweep": (_analyze(path, "--sweep", SWEEP[0], "--sweep", SWEEP[1]), False),
    }
    for name, (cmd, parse) in stages.items():
        print(f"  {num_layers} layers: {name} ...", flush=True)
        row[name] = _run(cmd, parse)
        status = f"{row[name]['wall_s']:.1f} s" if row[name]["ok"] else f"FAILED ({row[name]['error'][:200]})"
        print(f"  {num_layers} layers: {name}: {status}", flush=True)
    return row


# ---------------------------------------------------------------------------------------------------
# Targets and the written results
# ---------------------------------------------------------------------------------------------------
def _seconds(row: Optional[dict], stage: str) -> Optional[float]:
    """torch.export.load and block_pass count themselves alone ("seconds", timed inside the process);
    analyze stages count the whole subprocess (end to end)."""
    if not row or not row.get(stage, {}).get("ok"):
        return None
    data = row[stage]
    return data.get("seconds", data["wall_s"])


def _target(name: str, lhs: Optional[float], rhs: Optional[float], factor: float,
            what: str) -> dict[str, Any]:
    if lhs is None or rhs is None:
        return {"target": name, "what": what, "status": "not measured (a stage failed)", "met": None}
    ratio = lhs / rhs
    return {"target": name, "what": what, "lhs_s": lhs, "rhs_s": rhs, "ratio": ratio, "limit": factor,
            "met": ratio <= factor, "status": "met" if ratio <= factor else "not met"}


def targets(rows: list[dict]) -> list[dict]:
    by_layers = {r["layers"]: r for r in rows}
    small, big = by_layers.get(8), by_layers.get(80)
    return [
        _target("80-layer analyze --train <= 0.5x torch.export.load", _seconds(big, "analyze_train"),
                _seconds(big, "torch_export_load"), 0.5,
                "analyze --train (end to end) / torch.export.load (load only)"),
        _target("80-layer analysis <= 2x 8-layer analysis", _seconds(big, "analyze"),
                _seconds(small, "analyze"), 2.0, "analyze (inference, end to end), 80 / 8 layers"),
        _target("80-layer analysis --train <= 2x 8-layer", _seconds(big, "analyze_train"),
                _seconds(small, "analyze_train"), 2.0, "analyze --train (end to end), 80 / 8 layers"),
        _target("18-point sweep <= 2x single analysis (80 layers)", _seconds(big, "sweep"),
                _seconds(big, "analyze"), 2.0, "sweep (end to end) / analyze (end to end)"),
    ]


def to_markdown(rows: list[dict], goals: list[dict], meta: dict) -> str:
    def cell(row: dict, stage: str) -> str:
        data = row.get(stage)
        if not data:
            return "-"
        if not data.get("ok"):
            return "FAILED"
        return f"{_seconds(row, stage):.1f}"

    lines = [
        "# Speed: boomfx analyze on Llama-70B-shaped exports",
        "",
        "transformers LlamaConfig on meta (hidden 8192, MLP 28672, 64 heads, 8 KV heads, vocab 32000), "
        f"dynamic batch and seq; device {DEVICE}, --batch {BATCH} --seq {SEQ}; sweep {' x '.join(SWEEP)} "
        "(18 points). "
        f"Each stage is a fresh subprocess; analyze stages are timed end to end (interpreter start, imports, "
        f"load, passes, pricing), torch.export.load by itself. torch {meta['torch']}, "
        f"{meta['cpu_count']} CPUs, {meta['platform']}, {meta['date']}.",
        "",
        "| layers | export s | torch.export.load s | block_pass s | analyze s | analyze --train s "
        "| sweep (18) s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        export = r.get("export", {})
        if not export.get("ok"):
            exp = "FAILED"
        else:
            exp = "cached" if export.get("cached") else f"{export['seconds']:.0f}"
        lines.append(f"| {r['layers']} | {exp} | {cell(r, 'torch_export_load')} | {cell(r, 'block_pass')} | "
                     f"{cell(r, 'analyze')} | {cell(r, 'analyze_train')} | {cell(r, 'sweep')} |")
    lines += ["", "## Targets", "", "| target | measured | status |", "|---|---|---|"]
    for g in goals:
        measured = "-"
        if g.get("ratio") is not None:
            measured = f"{g['lhs_s']:.1f} s / {g['rhs_s']:.1f} s = {g['ratio']:.2f}x"
        lines.append(f"| {g['target']} | {measured} | {g['status']} |")
    failures = [(r["layers"], stage, d["error"]) for r in rows for stage, d in r.items()
                if isinstance(d, dict) and d.get("ok") is False]
    if failures:
        lines += ["", "## Failed stages", ""]
        lines += [f"- {layers} layers, {stage}: `{error[:400]}`" for layers, stage, error in failures]
    blocks = [(r["layers"], r["block_pass"]) for r in rows if r.get("block_pass", {}).get("ok")]
    if blocks:
        lines += ["", "## Blocks found", ""]
        lines += [f"- {layers} layers: {b['method']}, classes {b['classes']} in {b['seconds']:.2f} s"
                  for layers, b in blocks]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 80])
    parser.add_argument("--export-only", action="store_true", help="only build the cached exports")
    args = parser.parse_args()
    if args.export_only:
        for num_layers in args.layers:
            print(cached_export(num_layers)[0])
        return
    import torch

    rows = [measure(n) for n in args.layers]
    goals = targets(rows)
    meta = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "device": DEVICE, "batch": BATCH, "seq": SEQ,
            "sweep": list(SWEEP)}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "speed_llama70b.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "targets": goals}, indent=2) + "\n")
    (RESULTS_DIR / "speed_llama70b.md").write_text(to_markdown(rows, goals, meta))
    for g in goals:
        print(f"{g['target']}: {g['status']}")
    print(f"wrote {RESULTS_DIR / 'speed_llama70b.json'} and {RESULTS_DIR / 'speed_llama70b.md'}")


if __name__ == "__main__":
    main()
