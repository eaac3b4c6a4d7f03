"""What ``boomfx kernels collect --collectives`` and ``boomfx kernels import`` of collective files do.

The parser lives in ``cli/kernels.py``; ``cli/kernels_impl.py`` calls ``collect`` and ``try_import`` here.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional

from boomfx.core.errors import OptionError


def collect(args: argparse.Namespace, spec_name: str, path: Path) -> int:
    """Measure collectives with ``args.world`` local ranks (gloo on CPU, NCCL on GPUs) into ``path``."""
    from boomfx.kernels_db.collective_bench import collect_collectives
    from boomfx.kernels_db.store import Store
    world = args.world
    if world < 2:
        raise OptionError(f"--world must be at least 2 to measure collectives, got {world}")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    load = os.getloadavg()[0]
    run = collect_collectives(Store(path), world=world, backend=backend)
    print(f"collected {len(run.rows)} collectives ({backend}, {world} ranks on {spec_name}) into {path} "
          f"({run.elapsed_s:.1f} s, load average {load:.2f})")
    for op, why in run.failed:
        print(f"  {op}: not measured ({why})")
    if backend == "gloo":   # FSDP2's hooks on this host (kernels_db/framework_overheads.py)
        from boomfx.kernels_db.framework_overheads import collect_framework_costs
        from boomfx.kernels_db.host_overheads import FSDP_PARAM, FSDP_UNIT, TP_LINEAR
        from boomfx.kernels_db.measure import protocol_measurer
        costs = collect_framework_costs(Store(path), protocol_measurer("cpu"))
        print(f"host work at world size 1: FSDP2 {costs[FSDP_UNIT] / 1e3:.0f} us per unit + "
              f"{costs[FSDP_PARAM] / 1e3:.0f} us per parameter, DTensor {costs[TP_LINEAR] / 1e3:.0f} us per "
              f"tensor-parallel linear")
    return 0


def try_import(source: Path, args: argparse.Namespace, db_path) -> Optional[int]:
    """Import an nccl-tests output or the public NCCL table; None when ``source`` is neither."""
    from boomfx.kernels_db import collective_import as ci
    from boomfx.kernels_db.store import Store
    if ci.is_public_collectives_csv(source):
        by_device: dict[str, list] = {}
        for row in ci.iter_public_collectives(source):
            if args.device and row.device != args.device:
                continue
            by_device.setdefault(row.device, []).append(row)
        if not by_device:
            raise OptionError(f"no collective measurements in {source}" +
                              (f" for device {args.device}" if args.device else ""))
        for device, rows in sorted(by_device.items()):
            path = db_path(args.db, device)
            with Store(path) as store:
                n = store.put_many(ci.public_records(rows), replace=False)
            print(f"{device}: {n} new collective rows of {len(rows)} in {path}")
        return 0
    if not ci.is_nccl_tests_output(source):
        return None
    from boomfx.kernels_db.measure import registry_device_name
    for table in ci.parse_nccl_tests_runs(source, op=args.op, ranks_per_node=args.ranks_per_node):
        device = args.device or registry_device_name(table.gpu_name)
        if device is None:
            raise OptionError(f"{source}: GPU '{table.gpu_name}' is not in the device registry; pass --device NAME")
        path = db_path(args.db, device)
        with Store(path) as store:
            n = store.put_many(ci.nccl_tests_records(table, device, str(source)))
        print(f"{source}: {table.op}, {table.rows[0].world} ranks ({table.rows[0].ranks_per_node} per node) on "
              f"{device}: {n} rows into {path}")
    return 0
