"""How much of a CPU step is page faults on memory glibc hands back to the kernel and takes again, and how
far the glibc heap model (``boomfx/memory/glibc_heap.py``) predicts them.

Why: glibc's malloc serves a request it cannot place in its heap with a fresh ``mmap`` once the request is
at least its mmap threshold (128 KiB at start, raised to the size of each larger mmapped chunk freed, up to
32 MiB), and returns the top of its heap to the kernel once more than twice that is free there. Fresh
pages fault on first touch, so activations of 1-32 MiB can fault at every step of an eager loop.

For each configuration: ``PROCESSES`` fresh processes (as a user's run starts), each timing ``STEPS``
wall-clock steps after 3 warm-ups at torch's default threads and counting the minor faults of each
(``getrusage``); one more with glibc's dynamic behaviour off (``MALLOC_MMAP_THRESHOLD_`` 2 GiB,
``MALLOC_TRIM_THRESHOLD_`` 16 GiB: no fault after warm-up); and ``boomfx.analyze(..., device="cpu",
db="none")`` in the first process: its step time, the faults it charges (outputs glibc maps afresh) and
the heap refaults it only reports (pages a trim returned, ``time.heap_refault_estimate_ns``), both in pages.
The fault counts of one configuration move between processes and steps (what else the process allocated
decides whether a trim happens): the mean over all steps is what a step costs on average.

Run: ``python benchmarks/cpu_page_faults.py``; writes ``benchmarks/results/cpu_page_faults.{json,md}``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NO_DYNAMIC_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**31 - 1), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
# (name, kind, batch, size, width): conv = a ResNet-style stack at size x size pixels, mlp = a stack of
# transformer MLP blocks over batch x size tokens of width
CONFIGS = (("conv b8 56px", "conv", 8, 56, 64), ("conv b16 56px", "conv", 16, 56, 64),
           ("conv b32 56px", "conv", 32, 56, 64), ("conv b8 112px", "conv", 8, 112, 32),
           ("mlp 2x512 tok d768", "mlp", 2, 512, 768), ("mlp 4x1024 tok d768", "mlp", 4, 1024, 768),
           ("mlp 1x128 tok d768", "mlp", 1, 128, 768))

PROCESSES = 3
STEPS = 10

_ONE = r"""
import json, resource, statistics, sys, time
import torch
kind, batch, size, width, mode, predict = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1"
torch.manual_seed(0)

class ConvBlock(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
        self.c2, self.b2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c)
    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))

class MlpBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

if kind == "conv":
    model = torch.nn.Sequential(torch.nn.Conv2d(3, width, 3, padding=1), *[ConvBlock(width) for _ in range(3)],
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10))
    x = torch.randn(batch, 3, size, size)
else:
    model = torch.nn.Sequential(*[MlpBlock(width) for _ in range(4)])
    x = torch.randn(batch, size, width)
train = mode == "train"
opt = torch.optim.AdamW(model.parameters()) if train else None
model.train(train)           # inference as people run it: eval mode (batch norm's running statistics)

def step():
    if train:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    else:
        with torch.no_grad():
            model(x)

faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
times, counts = [], []
for _ in range(STEPS):
    f0, t0 = faults(), time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
    counts.append(faults() - f0)
out = {"times_ms": [t * 1e3 for t in times], "faults": counts}
if predict:
    import boomfx
    from boomfx.kernels_db.host_probe import host_profile
    report = boomfx.analyze(model, x, device="cpu", train=train, db="none")   # the host probe, as the CLI
    fault_ns = host_profile().page_fault_ns
    out.update(predicted_ms=report.time.total_ns / 1e6, page_fault_ns=fault_ns,
               charged_pages=report.time.page_faults_ns / fault_ns,
               refault_pages=report.time.heap_refault_estimate_ns / fault_ns)
print(json.dumps(out))
"""


# the small models of benchmarks/cpu_accuracy.py (2 layers, hidden 256, batch 4 x 128 tokens or 8 images), run as
# its CLI protocol does (torch's default optimizer loop), with the export's loss
BROAD = ("gpt2", "llama", "bert", "vit", "resnet", "swin", "mobilenetv2", "convnext")

_BROAD_ONE = r"""
import json, resource, sys
import torch
sys.path.insert(0, "benchmarks")
import cpu_accuracy as ca
import boomfx
from boomfx.kernels_db.host_probe import host_profile
from boomfx.training.trace import resolved_loss
name, train = sys.argv[1], sys.argv[2] == "train"
model, kwargs, dyn, dims = ca.build(name)
ep = ca.export_for(model, kwargs, dyn, train)
model.train(train)
step = ca.make_step(model, kwargs, train, resolved_loss(ep, "auto") if train else "mean", None)
for _ in range(3):
    step()
counts = []
for _ in range(STEPS):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
out = {"faults": counts}
if sys.argv[3] == "1":
    report = boomfx.analyze(ep, device="cpu", train=train, dims=dims, db="none")
    fault_ns = host_profile().page_fault_ns
    out.update(charged_pages=report.time.page_faults_ns / fault_ns,
               refault_pages=report.time.heap_refault_estimate_ns / fault_ns, predicted_ms=report.time.total_ns / 1e6)
print(json.dumps(out))
"""


def _child(script: str, *args: object, env: Optional[dict] = None) -> dict:
    """The JSON line a fresh process running ``script`` with ``args`` prints (its error's last line if it fails)."""
    proc = subprocess.run([sys.executable, "-c", script.replace("STEPS", str(STEPS)), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=900)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    rows = []
    for name, kind, batch, size, width in CONFIGS:
        for mode in ("inference", "train"):
            runs = [_child(_ONE, kind, batch, size, width, mode, int(i == 0)) for i in range(PROCESSES)]
            default = _summary(runs)
            steady = _summary([_child(_ONE, kind, batch, size, width, mode, 0, env=NO_DYNAMIC_MALLOC)])
            row = {"config": name, "mode": mode, "default": default, "no_dynamic_malloc": steady}
            rows.append(row)
            print(name, mode, default, steady, flush=True)
    broad = []
    for name in BROAD:
        for mode in ("inference", "train"):
            runs = [_child(_BROAD_ONE, name, mode, int(i == 0)) for i in range(PROCESSES)]
            row = {"model": name, "mode": mode, **_summary(runs)}
            broad.append(row)
            print(name, mode, row, flush=True)
    payload = {"started": started, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
               "torch_threads": "default", "rows": rows, "broad": broad}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_page_faults.json").write_text(json.dumps(payload, indent=1) + "\n")
    (RESULTS / "cpu_page_faults.md").write_text(render(payload))
    return 0


def _summary(runs: list[dict]) -> dict:
    """Median step (where timed) and mean faults over every step of every process; the first process's
    prediction."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"error": errors[0]}
    counts = [c for r in runs for c in r["faults"]]
    out = {"faults_per_step": statistics.mean(counts), "faults_min": min(counts), "faults_max": max(counts),
           "processes": len(runs)}
    if "times_ms" in runs[0]:
        out["real_ms"] = statistics.median(t for r in runs for t in r["times_ms"])
    out.update({k: v for k, v in runs[0].items() if k not in ("times_ms", "faults")})
    return out


def render(payload: dict) -> str:
    lines = ["# Page faults in CPU steps: glibc's dynamic mmap threshold and heap trimming", "",
             f"`python benchmarks/cpu_page_faults.py`; {payload['started']}; torch's default threads; "
             f"{PROCESSES} fresh processes per cell, each {STEPS} wall-timed steps after 3 warm-ups (real: the "
             "median step; faults: the mean, min and max over all steps); load average "
             f"{payload['loadavg_before'][0]:.1f} before, {payload['loadavg_after'][0]:.1f} after. 'no dynamic "
             "malloc': one process with MALLOC_MMAP_THRESHOLD_=2 GiB and MALLOC_TRIM_THRESHOLD_=16 GiB (no fault "
             "after warm-up). Predicted: boomfx.analyze(model, x, device='cpu', db='none') (this host's probe, as "
             "`boomfx analyze --device cpu`): its step time, the faults it charges (outputs glibc maps afresh) "
             "and the heap refaults it reports but does not charge (pages a trim returned), in pages.", "",
             "| config | mode | real | faults / step: mean (min-max) | real, no dynamic malloc | fault cost | "
             "model: charged + refaults | real / model | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        d, s = r["default"], r["no_dynamic_malloc"]
        if "error" in d or "error" in s:
            lines.append(f"| {r['config']} | {r['mode']} | {d.get('error') or s.get('error')} |||||||||")
            continue
        pred = d.get("predicted_ms")
        model_pages = d.get("charged_pages", 0.0) + d.get("refault_pages", 0.0)
        ratio = f"{d['faults_per_step'] / model_pages:.2f}" if model_pages else "-"
        lines.append(f"| {r['config']} | {r['mode']} | {d['real_ms']:.1f} ms | {d['faults_per_step']:.0f} "
                     f"({d['faults_min']}-{d['faults_max']}) | {s['real_ms']:.1f} ms | "
                     f"{(d['real_ms'] / s['real_ms'] - 1) * 100:+.0f}% | {d.get('charged_pages', 0):.0f} + "
                     f"{d.get('refault_pages', 0):.0f} | {ratio} | {pred:.1f} ms | {(pred / d['real_ms'] - 1) * 100:+.1f}% |")
    costs = {}
    for r in payload["rows"]:
        d, s = r["default"], r["no_dynamic_malloc"]
        if "error" not in d and "error" not in s:
            costs.setdefault((r["config"].split()[0], r["mode"]), []).append(d["real_ms"] / s["real_ms"] - 1)
    lines += ["", "Fault cost (real over real without dynamic malloc), mean by kind: " + "; ".join(
        f"{kind} {mode}: {sum(v) / len(v) * 100:+.0f}%" for (kind, mode), v in costs.items()) + ". The step "
        "time charges only the faults of outputs glibc maps afresh; the refaults after trims are reported "
        "(`time.heap_refault_estimate_ns`, a line of the text report), not charged: the runtime's own small "
        "allocations, which a graph does not show, decide whether a trim happens."]
    lines += ["", "## The small models of benchmarks/cpu_accuracy.py", "",
              "Built, exported and stepped as `cpu_accuracy.py --protocol nodb` does (its CLI protocol: torch's "
              "default optimizer loop, the export's loss); the prediction is `boomfx.analyze(export, "
              "device='cpu', dims=..., db='none')`.", "",
              "| model | mode | faults / step: mean (min-max) | model: charged + refaults | real / model |",
              "|---|---|---|---|---|"]
    for r in payload.get("broad", []):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r['error']} |||")
            continue
        model_pages = r.get("charged_pages", 0.0) + r.get("refault_pages", 0.0)
        ratio = f"{r['faults_per_step'] / model_pages:.2f}" if model_pages else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['faults_per_step']:.0f} ({r['faults_min']}-"
                     f"{r['faults_max']}) | {r.get('charged_pages', 0):.0f} + {r.get('refault_pages', 0):.0f} | "
                     f"{ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
