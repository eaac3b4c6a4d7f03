"""``boomfx validate FILE.pt2``: the parser's arguments and what the command prints."""
from __future__ import annotations

import argparse

from boomfx.core.losses import LOSSES


def add_validate_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("validate", help="predict one step, run it for real on this machine, compare")
    v.add_argument("file", help="a .pt2 file written by torch.export.save")
    v.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE")
    v.add_argument("--batch", type=int, help="bind the batch dimension (default: the export's example size, "
                                              "lowered until the step fits this machine)")
    v.add_argument("--seq", type=int, help="bind the sequence dimension")
    v.add_argument("--train", action="store_true", help="a training step (forward + backward + optimizer)")
    v.add_argument("--optimizer", default="adamw", help="sgd | adam | adamw | none (forward + backward only)")
    v.add_argument("--amp", default=None, help="bf16 | fp16 autocast")
    v.add_argument("--compile", action="store_true", help="torch.compile the model (Inductor)")
    v.add_argument("--resident-grads", action="store_true", help="zero_grad(set_to_none=False) steady state")
    v.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                   help="with --train: torch.optim's foreach implementation or its per-parameter loop (default: "
                        "torch's for the device, the loop on a CPU); the real step uses the same")
    v.add_argument("--loss", default="auto", choices=LOSSES, metavar="LOSS",
                   help="with --train: as analyze's --loss (the real step computes the same loss)")
    v.add_argument("--db", default="auto", help="kernel database for the prediction (path, auto, default, none)")
    v.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    v.add_argument("--repeats", type=int, default=10, help="timed real steps (median)")
    v.add_argument("--warmup", type=int, default=3, help="untimed real steps before timing")
    v.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda")
    v.add_argument("--calibrate", action="store_true",
                   help="store each op class's in-situ/predicted ratio in --db (labelled in-situ calibration)")
    v.add_argument("--top", type=int, default=8, help="op classes listed")
    v.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the result as JSON (to PATH, or stdout)")


def run_validate(args: argparse.Namespace) -> int:
    from boomfx.cli.args import parse_dim as _dim
    from boomfx.validate.render import render_validation
    from boomfx.validate.run import validate
    result = validate(args.file, train=args.train, optimizer=args.optimizer, amp=args.amp, compile=args.compile,
                      resident_grads=args.resident_grads, dims=dict(_dim(d) for d in args.dim), batch=args.batch,
                      seq=args.seq, db=args.db, threads=args.threads, repeats=args.repeats, warmup=args.warmup,
                      device=args.device, calibrate=args.calibrate, loss=args.loss, foreach=args.foreach)
    if args.json == "-":
        print(result.to_json())
        return 0
    print(render_validation(result, top=args.top))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(result.to_json())
    return 0
