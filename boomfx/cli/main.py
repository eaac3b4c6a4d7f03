"""Command line: ``boomfx analyze``, ``boomfx devices``, ``boomfx kernels ...``.

Bad input gets one line on stderr and exit status 2. A bug gets one line too, saying it is one, and exit
status 70; ``BOOMFX_TRACEBACK=1`` re-raises it with its traceback (for the report).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from boomfx import __version__
from boomfx.core.errors import BoomfxError
from boomfx.core.losses import LOSSES


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help shows each option's default, except where there is none to show (off flags, unset values)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default in (None, False, "", []) or default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, not usage + error
        # main() prefixes "boomfx: error: "; a subcommand's parser adds only its own name ("analyze: ...")
        command = self.prog.removeprefix("boomfx").strip()
        raise BoomfxError(f"{command}: {message}" if command else message)


def _add_program_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .pt2 file written by torch.export.save")
    p.add_argument("--device", default="a100-80gb", help="target device (see `boomfx devices`)")
    p.add_argument("--device-spec", default=None, metavar="FILE.json",
                   help="an unlisted device described in JSON with DeviceSpec's fields (overrides --device)")
    p.add_argument("--dim", action="append", default=[], type=str, metavar="NAME=VALUE",
                   help="bind a symbolic dimension (repeatable) by the Dim name given at export (in-memory "
                        "programs; a .pt2 does not keep it), by input and dimension (input_ids.1: dimension 1 "
                        "of input input_ids), by symbol (s0) or by role (batch, seq); the report lists every "
                        "symbol's names and an unknown name gets the list of valid ones")
    p.add_argument("--batch", type=int, help="bind the batch dimension")
    p.add_argument("--seq", type=int, help="bind the sequence dimension")
    p.add_argument("--train", action="store_true", help="predict a training step (forward + backward + optimizer)")
    p.add_argument("--optimizer", default=None, help="sgd | adam | adamw | none (forward + backward only); needs --train (default with --train: adamw)")
    p.add_argument("--amp", default=None, help="bf16 | fp16 autocast")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of each repeated layer")
    p.add_argument("--checkpoint-layers", default="", metavar="NAME,NAME",
                   help="checkpoint only these layer instances (module paths, e.g. h.0,h.2; needs --train)")
    p.add_argument("--loss", default="auto", choices=LOSSES, metavar="LOSS",
                   help="auto (default): cross-entropy against next-token labels when the first output is a language model's logits or the program takes labels, the output itself when it is a scalar, else its mean | cross_entropy | mean | output (needs --train)")
    p.add_argument("--resident-grads", action="store_true",
                   help="gradients stay allocated between steps (zero_grad(set_to_none=False), gradient "
                        "accumulation); default: freed after each step (needs --train)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.optim's implementation: --foreach (all parameters at once) or --no-foreach (its "
                        "per-parameter loop); default: torch's for the device's tensors, foreach on CUDA, the loop "
                        "on a CPU (needs --train)")
    p.add_argument("--python-locals", action=argparse.BooleanOptionalAction, default=True,
                   help="as the nn.Module runs eagerly (default): in inference tensors bound to its Python "
                        "locals live until rebound or returned and its experts call torch's grouped matmul on a "
                        "CPU; in inference and training (not --compile) transformers' attention calls SDPA causal "
                        "without the mask and repeated KV heads the export built; --no-python-locals: freed at "
                        "their last use, with the ops the export recorded, as the exported graph (ep.module()) runs")
    # compiled execution (passes/compiled.py)
    p.add_argument("--compile", action="store_true", help="predict torch.compile (Inductor fusion, one launch per kernel)")
    p.add_argument("--cudagraphs", action="store_true", help="with --compile: mode=reduce-overhead (CUDA graph replay)")
    p.add_argument("--db", default="auto",
                   help="kernel database: a path, 'default' (the user-cache one of --device), 'auto' (that one "
                        "if it exists; the default) or 'none'")
    p.add_argument("--from-db", default=None, help="a source GPU's database, transferred to --device")
    p.add_argument("--verbose", "-v", action="store_true", help="say what each stage does")


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="boomfx", description="Predict step time and GPU memory from a torch.export graph.")
    parser.add_argument("--version", action="version", version=f"boomfx {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    a = sub.add_parser("analyze", help="analyse an exported program")
    _add_program_args(a)
    a.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON (to PATH, or stdout)")
    a.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of the simulated step")
    a.add_argument("--memory-snapshot", metavar="FILE.pickle", help="write a torch memory_viz snapshot")
    a.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF-style allocator options")
    a.add_argument("--outside-memory", default="", help="override memory outside the allocator, e.g. cuda_context=600MiB")
    a.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2",
                   help="evaluate a grid of symbol values (repeatable) and print one table")
    a.add_argument("--max-batch", action="store_true", help="find the largest batch that fits")
    a.add_argument("--max-seq", action="store_true", help="find the largest sequence length that fits")
    a.add_argument("--top", type=int, default=8, help="rows per breakdown table (with --search: plans listed)")
    a.add_argument("--kernels", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="list the N slowest kernels with the source of each price (no N: every kernel)")
    a.add_argument("--no-reuse", action="store_true", help="analyse every layer instance separately")
    from boomfx.distributed.cli import add_parallel_args
    add_parallel_args(a)
    from boomfx.distributed.search_cli import add_search_args
    add_search_args(a)
    sub.add_parser("devices", help="list known devices")
    from boomfx.cli.kernels import add_kernels_parser
    add_kernels_parser(sub)
    from boomfx.serving.cli import add_serve_parser
    add_serve_parser(sub)
    from boomfx.validate.cli import add_validate_parser
    add_validate_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command == "analyze":
            from boomfx.core.gc_pause import gc_paused
            with gc_paused():  # scale: cyclic GC was ~25% of an 80-layer analysis (boomfx/core/gc_pause.py)
                from boomfx.cli.analyze import run_analyze
                return run_analyze(args)
        if args.command == "devices":
            return _devices()
        if args.command == "serve":
            from boomfx.serving.cli import run_serve
            return run_serve(args)
        if args.command == "validate":
            from boomfx.validate.cli import run_validate
            return run_validate(args)
        if args.command == "kernels":
            from boomfx.cli.kernels import run_kernels
            return run_kernels(args)
        parser.print_help()
        return 2
    except KeyboardInterrupt:
        print("boomfx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `boomfx kernels info | head`: the reader left; stop quietly, as a C tool would
        _silence_stdout()
        return _EXIT_SIGPIPE
    except Exception as exc:  # user errors: one line, exit 2; a bug: one line, exit 70 (traceback on request)
        message = _user_error_message(exc)
        if message is not None:
            print(f"boomfx: error: {message}", file=sys.stderr)
            return 2
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        first = str(exc).strip().splitlines()
        print(f"boomfx: internal error: {type(exc).__name__}: {first[0][:300] if first else ''} (a bug in boomfx, "
              f"not in your input; {TRACEBACK_ENV}=1 shows where; please report it)", file=sys.stderr)
        return EXIT_INTERNAL


_EXIT_SIGPIPE = 141   # 128 + SIGPIPE: what a shell reports for a writer killed by a closed pipe
EXIT_INTERNAL = 70    # sysexits' EX_SOFTWARE: boomfx failed, not the input (bad input is 2)
TRACEBACK_ENV = "BOOMFX_TRACEBACK"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):   # stdout without a file descriptor (captured in tests)
        pass


def _user_error_message(exc: BaseException) -> Optional[str]:
    from boomfx.core.devices import UnknownDeviceError
    from boomfx.frontend.loader import LoadError
    user_errors: tuple[type, ...] = (BoomfxError, UnknownDeviceError, LoadError)
    try:
        from boomfx.passes.evaluate import UnboundSymbolError
        user_errors += (UnboundSymbolError,)
    except ImportError:
        pass
    if isinstance(exc, user_errors):
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)):
        return str(exc)
    return None


def _interconnect(d) -> str:
    """'NVLink4 450 GB/s, NVSwitch, PCIe 5' (the collective model's facts, boomfx/core/devices.py)."""
    parts = []
    if d.nvlink_bytes_per_s:
        parts.append(f"NVLink{d.nvlink_generation} {d.nvlink_bytes_per_s / 1e9:.0f} GB/s"
                     + (", NVSwitch" if d.nvswitch else ", bridged pairs" if d.nvlink_bridge else ", mesh"))
    if d.pcie_generation:
        parts.append(f"PCIe {d.pcie_generation}")
    return ", ".join(parts) or "-"


def _devices() -> int:
    from boomfx.core.devices import list_devices
    from boomfx.core.units import fmt_bytes
    rows = []
    for d in list_devices():
        import torch
        bf16 = d.peak_flops_per_s.get(torch.bfloat16)
        rows.append((d.name, d.description, fmt_bytes(d.memory_bytes), d.memory_type or "-",
                     f"{d.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s",
                     f"{d.peak_flops_per_s[torch.float32] / 1e12:.1f}",
                     f"{bf16 / 1e12:.1f}" if bf16 else "-", str(d.sm_count or "-"), _interconnect(d)))
    header = ("name", "description", "memory", "DRAM", "bandwidth", "fp32 TF/s", "bf16 TF/s", "SMs",
              "interconnect (per GPU, one direction)")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print("\nPeaks are dense (no sparsity); each figure's source: boomfx/core/devices.py.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
