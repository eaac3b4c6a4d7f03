"""How much of a CPU step is page faults on memory glibc hands back to the kernel and takes again, and what
boomfx predicts for those steps.

Why: glibc's malloc serves a request it cannot place in its heap with a fresh ``mmap`` once the request is
at least its mmap threshold (128 KiB at start, raised to the size of each larger mmapped chunk freed, up to
32 MiB), and returns the top of its heap to the kernel once more than twice that is free there. Fresh
pages fault on first touch. Activations of 1-32 MiB (a convnet at batch 8-32, a transformer at a few
thousand tokens) therefore fault at every step in an eager loop, at a rate set by the order of the
process's allocations. The CPU model (``kernels_db/cpu_model.py``) charges faults only for outputs of
32 MiB or more (always mmapped).

For each configuration, in a fresh process (as a user's run starts): the median step over 7 wall-timed
steps after 3 warm-ups at torch's default threads, the minor faults per step (``getrusage``), the same
with glibc's dynamic behaviour off (``MALLOC_MMAP_THRESHOLD_`` 2 GiB, ``MALLOC_TRIM_THRESHOLD_`` 16 GiB:
no fault after warm-up), and ``boomfx.analyze(..., device="cpu", db="none")`` (no database: the host
probe's model, what ``boomfx analyze --device cpu`` uses without a collected database; the Python API
without ``db=`` prices a nominal roofline instead). The difference between the two real steps is what the faults cost.

Run: ``python benchmarks/cpu_page_faults.py``; writes ``benchmarks/results/cpu_page_faults.{json,md}``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NO_DYNAMIC_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(2**31 - 1), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
# (name, kind, batch, size, width): conv = a ResNet-style stack at size x size pixels, mlp = a stack of
# transformer MLP blocks over batch x size tokens of width
CONFIGS = (("conv b8 56px", "conv", 8, 56, 64), ("conv b16 56px", "conv", 16, 56, 64),
           ("conv b32 56px", "conv", 32, 56, 64), ("conv b8 112px", "conv", 8, 112, 32),
           ("mlp 2x512 tok d768", "mlp", 2, 512, 768), ("mlp 4x1024 tok d768", "mlp", 4, 1024, 768),
           ("mlp 1x128 tok d768", "mlp", 1, 128, 768))

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
for _ in range(7):
    f0, t0 = faults(), time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
    counts.append(faults() - f0)
out = {"real_ms": statistics.median(times) * 1e3, "faults_per_step": statistics.median(counts)}
if predict:
    import boomfx
    report = boomfx.analyze(model, x, device="cpu", train=train, db="none")   # the host probe, as the CLI
    out["predicted_ms"] = report.time.total_ns / 1e6
print(json.dumps(out))
"""


def _run(kind: str, batch: int, size: int, width: int, mode: str, predict: bool, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", _ONE, kind, str(batch), str(size), str(width), mode,
                           "1" if predict else "0"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=900)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    rows = []
    for name, kind, batch, size, width in CONFIGS:
        for mode in ("inference", "train"):
            default = _run(kind, batch, size, width, mode, True, {})
            steady = _run(kind, batch, size, width, mode, False, NO_DYNAMIC_MALLOC)
            row = {"config": name, "mode": mode, "default": default, "no_dynamic_malloc": steady}
            rows.append(row)
            print(name, mode, default, steady, flush=True)
    payload = {"started": started, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
               "torch_threads": "default", "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_page_faults.json").write_text(json.dumps(payload, indent=1) + "\n")
    (RESULTS / "cpu_page_faults.md").write_text(render(payload))
    return 0


def render(payload: dict) -> str:
    lines = ["# Page faults in CPU steps: glibc's dynamic mmap threshold and heap trimming", "",
             f"`python benchmarks/cpu_page_faults.py`; {payload['started']}; torch's default threads; each "
             "cell a fresh process, median of 7 wall-timed steps after 3 warm-ups; load average "
             f"{payload['loadavg_before'][0]:.1f} before, {payload['loadavg_after'][0]:.1f} after. 'no dynamic "
             "malloc': the same process with MALLOC_MMAP_THRESHOLD_=2 GiB and MALLOC_TRIM_THRESHOLD_=16 GiB "
             "(no fault after warm-up). Predicted: boomfx.analyze(model, x, device='cpu', db='none'): this host's probe, no database (as `boomfx analyze --device cpu`).", "",
             "| config | mode | real | faults / step | real, no dynamic malloc | faults / step | fault cost | "
             "predicted | error vs real | error vs no dynamic malloc |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        d, s = r["default"], r["no_dynamic_malloc"]
        if "error" in d or "error" in s:
            lines.append(f"| {r['config']} | {r['mode']} | {d.get('error') or s.get('error')} |||||||")
            continue
        pred = d.get("predicted_ms")
        lines.append(f"| {r['config']} | {r['mode']} | {d['real_ms']:.1f} ms | {d['faults_per_step']:.0f} | "
                     f"{s['real_ms']:.1f} ms | {s['faults_per_step']:.0f} | "
                     f"{(d['real_ms'] / s['real_ms'] - 1) * 100:+.0f}% | {pred:.1f} ms | "
                     f"{(pred / d['real_ms'] - 1) * 100:+.1f}% | {(pred / s['real_ms'] - 1) * 100:+.1f}% |")
    costs = {}
    for r in payload["rows"]:
        d, s = r["default"], r["no_dynamic_malloc"]
        if "error" not in d and "error" not in s:
            costs.setdefault((r["config"].split()[0], r["mode"]), []).append(d["real_ms"] / s["real_ms"] - 1)
    lines += ["", "Fault cost (real over real without dynamic malloc), mean by kind: " + "; ".join(
        f"{kind} {mode}: {sum(v) / len(v) * 100:+.0f}%" for (kind, mode), v in costs.items()) + ". The CPU "
        "model (kernels_db/cpu_model.py) charges page faults only for outputs of 32 MiB or more, so the faults of "
        "smaller outputs (and of oneDNN's reorder buffers) are missing from 'predicted'."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
