"""CPU convolutions one at a time: this host's measured time against the CPU model's price (no database).

Each convolution (dense 1x1 and kxk, strided, grouped, a 7x7 stem, transposed; forward and backward) is
timed alone at torch's default thread count (wall clock, median of 5 batches of calls after warm-up, its
output coming from glibc's heap: the mmap threshold is raised first, as a running step leaves it) and priced
by ``kernels_db/cpu_model.py:CpuKernelModel`` over this host's probe, plus the probe's dispatch (the host
time a step charges each op). The shapes are not the probe's own (``host_probe.CONV_SHAPES``) except where
noted. Writes ``benchmarks/results/cpu_conv_shapes.{json,md}``::

    python benchmarks/cpu_conv_shapes.py [--stem cpu_conv_shapes]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from boomfx.core.devices import cpu_spec
from boomfx.kernels_db.cpu_model import CpuKernelModel
from boomfx.kernels_db.host_probe import host_profile, raise_mmap_threshold
from boomfx.passes.costs.registry import OpCall, price_call
from boomfx.passes.specs import TensorSpec, contiguous_strides

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
aten = torch.ops.aten

# (N, C, H, O, k, stride, groups)
FORWARD = [(4, 8, 1, 32, 1, 1, 1), (4, 32, 16, 32, 1, 1, 1), (4, 64, 8, 64, 1, 1, 1), (4, 32, 32, 32, 1, 1, 1),
           (4, 256, 2, 256, 1, 1, 1), (8, 64, 56, 256, 1, 1, 1), (8, 256, 56, 64, 1, 1, 1),
           (4, 3, 64, 32, 3, 2, 1), (4, 32, 32, 32, 3, 1, 1), (4, 64, 32, 64, 3, 1, 1), (4, 128, 16, 128, 3, 1, 1),
           (4, 32, 64, 32, 3, 1, 1), (8, 64, 56, 64, 3, 1, 1), (8, 128, 28, 128, 3, 1, 1), (8, 512, 7, 512, 3, 1, 1),
           (1, 64, 56, 64, 3, 1, 1), (2, 32, 128, 32, 3, 1, 1), (8, 3, 224, 64, 7, 2, 1),
           (4, 32, 32, 32, 3, 2, 2), (4, 128, 8, 128, 3, 2, 8)]
BACKWARD = [(4, 32, 16, 32, 1, 1, 1), (4, 32, 32, 32, 1, 1, 1), (8, 256, 28, 64, 1, 1, 1), (8, 64, 28, 256, 1, 1, 1),
            (4, 32, 32, 32, 3, 1, 1), (4, 128, 16, 128, 3, 1, 1), (8, 128, 28, 128, 3, 1, 1),
            (4, 32, 32, 32, 3, 2, 2)]
# (N, C, H, O, k, stride, padding): ConvTranspose2d as U-Nets and decoders use it
TRANSPOSED = [(4, 128, 16, 64, 2, 2, 0), (4, 64, 32, 32, 2, 2, 0), (16, 128, 8, 64, 4, 2, 1),
              (16, 32, 32, 3, 4, 2, 1), (8, 64, 28, 64, 3, 1, 1)]


def _spec(*shape: int) -> TensorSpec:
    return TensorSpec(tuple(shape), contiguous_strides(tuple(shape)), torch.float32)


def _median_ns(fn) -> float:
    fn()
    t0 = time.perf_counter_ns()
    fn()
    calls = max(3, min(200, int(1e7 / max(time.perf_counter_ns() - t0, 1))))
    batches = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(batches)


def _row(kind: str, shape: tuple, call: OpCall, fn, model: CpuKernelModel, dispatch: float) -> dict:
    real = _median_ns(fn)
    predicted = model(call, cpu_spec()) + dispatch
    flops = float(price_call(call).cost.evaluate()[0])
    row = {"kind": kind, "shape": list(shape), "flops": flops, "real_us": real / 1e3, "predicted_us": predicted / 1e3,
           "error": predicted / real - 1, "curve": bool(model.conv_curve(call))}
    print(json.dumps(row), flush=True)
    return row


def run() -> list[dict]:
    profile = host_profile()
    # the looped price, as the call is timed here (the in-step ratios price a kernel inside a step)
    model = CpuKernelModel(dataclasses.replace(profile, in_step=()))
    raise_mmap_threshold()                    # outputs from glibc's heap, as in a running step
    rows = []
    with torch.no_grad():
        for n, c, h, o, k, s, g in FORWARD:
            x, w = torch.randn(n, c, h, h), torch.randn(o, c // g, k, k)
            ho = (h + 2 * (k // 2) - k) // s + 1
            call = OpCall.build(aten.conv2d.default, (_spec(n, c, h, h), _spec(o, c // g, k, k), None, [s, s],
                                                      [k // 2, k // 2], [1, 1], g), {}, (_spec(n, o, ho, ho),))
            rows.append(_row("forward", (n, c, h, o, k, s, g), call,
                             lambda: aten.conv2d(x, w, None, [s, s], [k // 2, k // 2], [1, 1], g), model,
                             profile.dispatch_ns))
        for n, c, h, o, k, s, g in BACKWARD:
            x, w = torch.randn(n, c, h, h), torch.randn(o, c // g, k, k)
            ho = (h + 2 * (k // 2) - k) // s + 1
            grad = torch.randn(n, o, ho, ho)
            args = ([s, s], [k // 2, k // 2], [1, 1], False, [0, 0], g, [True, True, False])
            call = OpCall.build(aten.convolution_backward.default,
                                (_spec(n, o, ho, ho), _spec(n, c, h, h), _spec(o, c // g, k, k), None, *args), {},
                                (_spec(n, c, h, h), _spec(o, c // g, k, k)))
            rows.append(_row("backward", (n, c, h, o, k, s, g), call,
                             lambda: aten.convolution_backward(grad, x, w, None, *args), model, profile.dispatch_ns))
        for n, c, h, o, k, s, p in TRANSPOSED:
            x, w, b = torch.randn(n, c, h, h), torch.randn(c, o, k, k), torch.randn(o)
            ho = (h - 1) * s - 2 * p + k
            call = OpCall.build(aten.conv_transpose2d.input, (_spec(n, c, h, h), _spec(c, o, k, k), _spec(o), [s, s],
                                                              [p, p]), {}, (_spec(n, o, ho, ho),))
            rows.append(_row("transposed", (n, c, h, o, k, s, p), call,
                             lambda: aten.conv_transpose2d(x, w, b, [s, s], [p, p]), model, profile.dispatch_ns))
    return rows


def render(payload: dict) -> str:
    lines = ["# CPU convolutions alone: measured vs the CPU model's price", "",
             f"{payload['host']}; {payload['when']}; `{payload['command']}`. Real: median wall time of one call "
             "(batches of calls after warm-up, outputs from the heap); predicted: `CpuKernelModel` over this "
             "host's probe plus its dispatch. Shapes: forward/backward (N, C, H=W, out channels, kernel, stride, "
             "groups), transposed (N, C, H=W, out channels, kernel, stride, padding). 'curve': priced on the "
             "probe's oneDNN convolution curves (else the GEMM's rate or a transposed convolution's FLOPs).", "",
             "| kind | shape | MFLOP | real | predicted | error | curve |", "|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['kind']} | {tuple(r['shape'])} | {r['flops'] / 1e6:.1f} | {r['real_us']:.1f} us | "
                     f"{r['predicted_us']:.1f} us | {r['error']:+.1%} | {'yes' if r['curve'] else 'no'} |")
    lines.append("")
    for kind in ("forward", "backward", "transposed"):
        errs = [r["error"] for r in payload["rows"] if r["kind"] == kind]
        if errs:
            lines.append(f"- {kind}: median |error| {statistics.median(abs(e) for e in errs):.1%}, "
                         f"mean signed {statistics.mean(errs):+.1%}, worst {max(errs, key=abs):+.1%} ({len(errs)} shapes)")
    return "\n".join(lines) + "\n"


def write_results(stem: str, command: str, rows: list[dict], render_md) -> None:
    """``benchmarks/results/<stem>.{json,md}`` of one run of a kernels-alone benchmark (this host, when, the
    command, its rows; the markdown from ``render_md(payload)``), printed too."""
    payload = {"host": f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}",
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command, "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write(render_md(payload))
    print(render_md(payload))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stem", default="cpu_conv_shapes")
    write_results(parser.parse_args().stem, "python benchmarks/cpu_conv_shapes.py", run(), render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
