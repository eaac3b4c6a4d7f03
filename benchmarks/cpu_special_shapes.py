"""CPU arithmetic-bound kernels one at a time (norms, softmaxes, special functions): this host's measured time
against the CPU model's price (no database).

Each call (layer and group norms, batch norm in eval and training mode, softmax and log-softmax over rows
of several lengths, GELU/SiLU/exp/tanh/sigmoid and two backwards) is timed alone at torch's default thread
count (wall clock, median of 5 batches of calls after warm-up, outputs from glibc's heap) and priced by
``kernels_db/cpu_model.py:CpuKernelModel`` over this host's probe plus the probe's dispatch, as
``cpu_conv_shapes.py`` does for convolutions. The shapes are those of real models' layers (hidden sizes
64-4096, batch x sequence 128-16384 rows), none of them a probe point. Writes
``benchmarks/results/cpu_special_shapes.{json,md}``::

    python benchmarks/cpu_special_shapes.py [--stem cpu_special_shapes]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from boomfx.core.devices import cpu_spec
from boomfx.kernels_db.cpu_model import CpuKernelModel
from boomfx.kernels_db.host_probe import host_profile, raise_mmap_threshold
from boomfx.passes.costs.registry import OpCall

from cpu_conv_shapes import _median_ns, _spec, write_results

aten = torch.ops.aten

ROWS = {"layer_norm": [(256, 128), (128, 64), (512, 768), (2048, 768), (1024, 384), (64, 4096), (4096, 1024),
                       (4096, 128)],
        "_softmax": [(1024, 64), (1536, 128), (12288, 512), (64, 1000), (16384, 64), (3072, 1024)],
        "_log_softmax": [(512, 4096), (128, 1000), (2048, 512)],
        "native_layer_norm_backward": [(256, 128), (512, 768), (4096, 1024)]}
POINTWISE = {"gelu": [4096, 98304, 131072, 1 << 21, 3 * (1 << 20)], "silu": [98304, 704512, 1 << 22],
             "exp": [65536, 1 << 20], "tanh": [153600, 24576], "sigmoid": [262144, 12288],
             "gelu_backward": [131072, 1 << 21]}
IMAGES = {"batch_norm": [(4, 64, 32, 32), (8, 256, 14, 14), (4, 96, 16, 16), (32, 64, 56, 56)],
          "batch_norm@train": [(4, 64, 32, 32), (8, 128, 28, 28)],
          "native_group_norm": [(4, 64, 32, 32), (2, 128, 64, 64)]}


def _row(kind: str, shape: tuple, call: OpCall, fn, model: CpuKernelModel, dispatch: float) -> dict:
    real = _median_ns(fn)
    predicted = model(call, cpu_spec()) + dispatch
    row = {"kind": kind, "shape": list(shape), "real_us": real / 1e3, "predicted_us": predicted / 1e3,
           "error": predicted / real - 1}
    print(json.dumps(row), flush=True)
    return row


def _cases():
    """(kind, shape, OpCall, callable) of every benchmarked call."""
    for m, n in ROWS["layer_norm"]:
        x, g, b = torch.randn(m, n), torch.ones(n), torch.zeros(n)
        call = OpCall.build(aten.layer_norm.default, (_spec(m, n), [n], _spec(n), _spec(n)), {}, (_spec(m, n),))
        yield "layer_norm", (m, n), call, lambda x=x, g=g, b=b, n=n: aten.layer_norm(x, [n], g, b)
    for op in ("_softmax", "_log_softmax"):
        for m, n in ROWS[op]:
            x = torch.randn(m, n)
            call = OpCall.build(getattr(aten, op).default, (_spec(m, n), -1, False), {}, (_spec(m, n),))
            yield op, (m, n), call, lambda x=x, f=getattr(aten, op): f(x, -1, False)
    for m, n in ROWS["native_layer_norm_backward"]:
        x, grad, g, b = torch.randn(m, n), torch.randn(m, n), torch.ones(n), torch.zeros(n)
        _, mean, rstd = aten.native_layer_norm(x, [n], g, b, 1e-5)
        args = (_spec(m, n), _spec(m, n), [n], _spec(m, 1), _spec(m, 1), _spec(n), _spec(n), [True, True, True])
        call = OpCall.build(aten.native_layer_norm_backward.default, args, {}, (_spec(m, n), _spec(n), _spec(n)))
        yield "native_layer_norm_backward", (m, n), call, (
            lambda x=x, grad=grad, g=g, b=b, mean=mean, rstd=rstd, n=n:
            aten.native_layer_norm_backward(grad, x, [n], mean, rstd, g, b, [True, True, True]))
    for op, sizes in POINTWISE.items():
        for size in sizes:
            x = torch.randn(size)
            if op == "gelu_backward":
                call = OpCall.build(aten.gelu_backward.default, (_spec(size), _spec(size)), {}, (_spec(size),))
                yield op, (size,), call, lambda x=x: aten.gelu_backward(x, x)
            else:
                f = getattr(aten, op)
                call = OpCall.build(f.default, (_spec(size),), {}, (_spec(size),))
                yield op, (size,), call, lambda x=x, f=f: f(x)
    for kind, shapes in IMAGES.items():
        for shape in shapes:
            x, c = torch.randn(*shape), shape[1]
            w, b, mean, var = torch.ones(c), torch.zeros(c), torch.zeros(c), torch.ones(c)
            if kind == "native_group_norm":
                n, hw = shape[0], shape[2] * shape[3]
                args = (_spec(*shape), _spec(c), _spec(c), n, c, hw, 8, 1e-5)
                call = OpCall.build(aten.native_group_norm.default, args, {}, (_spec(*shape), _spec(n, 8), _spec(n, 8)))
                yield kind, shape, call, (lambda x=x, w=w, b=b, n=n, c=c, hw=hw:
                                          aten.native_group_norm(x, w, b, n, c, hw, 8, 1e-5))
                continue
            train = kind == "batch_norm@train"
            args = (_spec(*shape), _spec(c), _spec(c), _spec(c), _spec(c), train, 0.1, 1e-5, True)
            call = OpCall.build(aten.batch_norm.default, args, {}, (_spec(*shape),))
            yield kind, shape, call, (lambda x=x, w=w, b=b, mean=mean, var=var, train=train:
                                      aten.batch_norm(x, w, b, mean, var, train, 0.1, 1e-5, True))


def run() -> list[dict]:
    profile = host_profile()
    # the looped price, as the call is timed here (the in-step ratios price a kernel inside a step)
    model = CpuKernelModel(dataclasses.replace(profile, in_step=()))
    raise_mmap_threshold()                    # outputs from glibc's heap, as in a running step
    with torch.no_grad():
        return [_row(kind, shape, call, fn, model, profile.dispatch_ns) for kind, shape, call, fn in _cases()]


def render(payload: dict) -> str:
    lines = ["# CPU norms, softmaxes and special functions alone: measured vs the CPU model's price", "",
             f"{payload['host']}; {payload['when']}; `{payload['command']}`. Real: median wall time of one call "
             "(batches of calls after warm-up, outputs from the heap); predicted: `CpuKernelModel` over this "
             "host's probe plus its dispatch. Shapes: rows x row length for the norms and softmaxes, elements "
             "for the pointwise ops, NCHW for batch and group norm.", "",
             "| kind | shape | real | predicted | error |", "|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['kind']} | {tuple(r['shape'])} | {r['real_us']:.1f} us | {r['predicted_us']:.1f} us | "
                     f"{r['error']:+.1%} |")
    errs = [r["error"] for r in payload["rows"]]
    lines += ["", f"All {len(errs)} calls: median |error| {statistics.median(abs(e) for e in errs):.1%}, mean signed "
              f"{statistics.mean(errs):+.1%}, worst {max(errs, key=abs):+.1%}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stem", default="cpu_special_shapes")
    write_results(parser.parse_args().stem, "python benchmarks/cpu_special_shapes.py", run(), render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
