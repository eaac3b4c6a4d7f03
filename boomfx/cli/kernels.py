"""``boomfx kernels collect|import|export|info``: build and share kernel (and collective) databases."""
from __future__ import annotations

import argparse

from boomfx.core.losses import LOSSES


def add_kernels_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("kernels", help="measure, import and export kernel databases")
    ksub = k.add_subparsers(dest="kernels_command", parser_class=type(k))
    c = ksub.add_parser("collect", help="measure kernels on this machine's device")
    c.add_argument("--device", default="cpu", help="cpu | cuda")
    c.add_argument("--db", default=None, help="database path (default: per device in the user cache)")
    c.add_argument("--for", dest="for_file", default=None, metavar="FILE.pt2",
                   help="measure exactly the kernels this program needs")
    c.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE")
    c.add_argument("--batch", type=int)
    c.add_argument("--seq", type=int)
    c.add_argument("--train", action="store_true")
    c.add_argument("--optimizer", default="adamw")
    c.add_argument("--amp", default=None)
    c.add_argument("--checkpoint", action="store_true")
    c.add_argument("--checkpoint-layers", default="", metavar="NAME,NAME")
    c.add_argument("--resident-grads", action="store_true")
    c.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                   help="with --train: as analyze's --foreach/--no-foreach")
    c.add_argument("--loss", default="auto", choices=LOSSES, metavar="LOSS", help="with --train: as analyze's --loss")
    c.add_argument("--python-locals", action=argparse.BooleanOptionalAction, default=True,
                   help="with --for: as analyze's --python-locals/--no-python-locals (the kernels of the program it "
                        "prices: the eager module's attention and experts, or the export's own)")
    c.add_argument("--compile", action="store_true",
                   help="with --for: the kernels torch.compile (Inductor) runs; each unique fused group is "
                        "compiled and timed here, so --compile predictions are measured")
    c.add_argument("--blocks", action="store_true",  # block mode: kernels_db/blocks_db.py
                   help="with --for: run each repeated block whole at the target sizes and store its time")
    c.add_argument("--in-step", action=argparse.BooleanOptionalAction, default=True,  # kernels_db/in_step.py
                   help="with --for on a CPU (eager): also time every kernel where it stands in the program's "
                        "step (its other kernels run in between) and price it by that (default: on)")
    c.add_argument("--families", default=None, help="sweep mode: comma-separated op families")
    c.add_argument("--dtypes", default="float32", help="sweep mode: comma-separated dtypes")
    c.add_argument("--budget", default=None, help="time budget, e.g. 90s, 10m, 1h")
    c.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads while measuring (default: torch's); match the runs you predict, "
                        "and use 1 on a machine shared with other jobs")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--collectives", action="store_true",  # boomfx/cli/collectives.py
                   help="measure collectives (gloo on cpu, NCCL on cuda) with --world local ranks")
    c.add_argument("--world", type=int, default=2, help="with --collectives: local ranks (default 2)")
    from boomfx.distributed.cli import add_parallel_args   # --for FILE --parallel: every rank class's kernels
    add_parallel_args(c)
    i = ksub.add_parser("import", help="import CSV measurements (boomfx CSV or the public GPU data set)")
    i.add_argument("path", help="a CSV file exported by boomfx, or a directory of public measurements")
    i.add_argument("--db", default=None)
    i.add_argument("--device", default=None, help="with public data: import only this device; with an nccl-tests "
                                                  "table: the device it ran on (default: from its Rank lines)")
    i.add_argument("--op", default=None, help="nccl-tests table: the collective (default: from the file)")
    i.add_argument("--ranks-per-node", type=int, default=None,
                   help="nccl-tests table: ranks per node (default: from its hosts)")
    e = ksub.add_parser("export", help="export a database as CSV")
    e.add_argument("path")
    e.add_argument("--db", required=True)
    n = ksub.add_parser("info", help="summarise a database")
    n.add_argument("--db", required=True)


def run_kernels(args: argparse.Namespace) -> int:
    from boomfx.cli.kernels_impl import run
    return run(args)
