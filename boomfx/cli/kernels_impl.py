"""What ``boomfx kernels collect|import|export|info`` do (the parser is in ``cli_kernels``)."""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import torch

from boomfx.core.errors import OptionError

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_budget(text: Optional[str]) -> Optional[float]:
    """'90s', '10m', '1h', '300' -> seconds."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise OptionError(f"--budget expects a duration like 90s, 10m or 1h, got '{text}'")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _local_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise OptionError("--device cuda: no CUDA device is available on this machine")
        return torch.device(name)
    raise OptionError(f"unknown collection device '{name}' (cpu or cuda)")


def _target_spec(device: torch.device):
    from boomfx.kernels_db.measure import local_device_spec
    try:
        return local_device_spec(device)
    except LookupError as exc:
        raise OptionError(str(exc)) from None


def _db_path(db: Optional[str], spec_name: str) -> Path:
    from boomfx.kernels_db.store import default_db_path
    return Path(db) if db and db != "default" else default_db_path(spec_name)


def run(args: argparse.Namespace) -> int:
    command = args.kernels_command
    if command == "collect":
        return _collect(args)
    if command == "import":
        return _import(args)
    if command == "export":
        return _export(args)
    if command == "info":
        return _info(args)
    raise OptionError("boomfx kernels: choose collect, import, export or info")


def _collect(args: argparse.Namespace) -> int:
    from boomfx.kernels_db.collect import collect_calls, collect_sweep
    from boomfx.kernels_db.measure import protocol_measurer
    from boomfx.kernels_db.store import Store
    device = _local_device(args.device)
    spec = _target_spec(device)
    budget = parse_budget(args.budget)
    path = _db_path(args.db, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    parallel = _parallel(args)
    if args.collectives:   # collectives with local ranks (boomfx/cli/collectives.py)
        from boomfx.cli.collectives import collect
        return collect(args, spec.name, path)
    progress = False if args.quiet else None
    threads = args.threads
    local_ranks = parallel.gpus_per_node_or_product if parallel is not None else 1   # ranks sharing this host
    if threads is None and device.type == "cpu" and local_ranks > 1:
        threads = 1   # torchrun starts each of several local ranks with OMP_NUM_THREADS=1
        print(f"--parallel: {local_ranks} ranks on this host, measuring at one thread each as torchrun "
              "runs them (--threads to choose)", file=sys.stderr)
    if threads is not None:
        if threads < 1:
            raise OptionError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    if args.blocks and not args.for_file:  # --blocks (kernels_db/blocks_db.py) measures a program's blocks
        raise OptionError("--blocks needs --for FILE.pt2")
    if args.compile and (not args.for_file or args.blocks):
        raise OptionError("--compile needs --for FILE.pt2 (and no --blocks)")
    if args.for_file:
        from boomfx.analysis.analysis import Analysis, AnalyzeOptions
        from boomfx.frontend.capture import capture, resolve_bindings
        from boomfx.cli.args import parse_dim
        from boomfx.core.program import ProgramOptions
        from boomfx.frontend.foreign import import_libraries, stand_ins_called
        options = ProgramOptions(args.train, args.optimizer, args.amp, args.checkpoint, target_kind=spec.kind,
                                 checkpoint_layers=args.checkpoint_layers, resident_grads=args.resident_grads,
                                 compile=args.compile, loss=args.loss,
                                 # every rank rewrite starts from the foreach step (distributed/ranks.py)
                                 foreach=True if args.foreach is None and parallel is not None else args.foreach,
                                 python_locals=args.python_locals)
        program = capture(args.for_file, options=options)
        if import_libraries(stand_ins_called(program.graph)):   # measure the library's own op, not a stand-in
            program = capture(args.for_file, options=options)
        bindings = resolve_bindings(program, dict(parse_dim(d) for d in args.dim), args.batch, args.seq)
        # the single-device program's analysis (--parallel builds each rank class's instead)
        analysis = Analysis(program, spec, AnalyzeOptions(spec.name, db="none")) if parallel is None else None
        if args.blocks:  # block mode: whole repeated blocks, one row per class (kernels_db/blocks_db.py)
            from boomfx.kernels_db.blocks_db import collect_blocks
            blocks = collect_blocks(Store(path), analysis, bindings, device, budget, progress)
            print(blocks.summary(args.for_file, path))
            return 0
        measurer = protocol_measurer(device)   # after the thread count (it picks the clock); not for blocks
        if args.compile:   # fused groups compiled with Inductor and timed as its graph calls them, then the rest
            from boomfx.kernels_db.collect_fused import FusedMeasurer, collect_compiled
            fused_measurer = protocol_measurer(device, FusedMeasurer)
            fused, result = collect_compiled(Store(path), analysis, bindings, measurer,
                                             fused_measurer, budget, progress)
            print(f"compiled groups of {args.for_file}: measured {fused.measured}, already present "
                  f"{fused.skipped}, failed {len(fused.failed)}, left for later {fused.pending} "
                  f"({fused.elapsed_s:.1f} s)")
            what = f"the library kernels of {args.for_file}"
            if device.type == "cpu" and args.in_step and not (result.pending or fused.pending):
                what += _in_step(path, analysis.kernel_calls(bindings), fused_measurer, analysis.kernel_operands())
        elif parallel is not None:   # each rank class's program, as analyze --parallel builds and prices it
            per_class = _rank_class_calls(program, parallel, spec, bindings)
            calls = [c for class_calls, _ in per_class for c in class_calls]
            result = collect_calls(Store(path), calls, device, budget, progress, measurer=measurer)
            what = f"{len(calls)} kernels of {len(per_class)} rank classes of {args.for_file} ({parallel.describe()})"
            if device.type == "cpu" and args.in_step and not result.pending:
                what += "".join(_in_step(path, class_calls, measurer, operands)
                                for class_calls, operands in per_class)
            if device.type == "cpu" and (parallel.dp_shard > 1 or parallel.tp > 1):
                from boomfx.kernels_db.framework_overheads import collect_framework_costs
                collect_framework_costs(Store(path), measurer)   # FSDP2's hooks, DTensor's dispatch
        else:
            calls = analysis.kernel_calls(bindings)
            result = collect_calls(Store(path), calls, device, budget, progress, measurer=measurer)
            what = f"{len(calls)} kernels of {args.for_file}"
            if device.type == "cpu" and args.in_step and not result.pending:
                what += _in_step(path, calls, measurer, analysis.kernel_operands())
    else:
        dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
        families = [f.strip() for f in args.families.split(",")] if args.families else None
        measurer = protocol_measurer(device)
        result = collect_sweep(Store(path), device, families=families, dtypes=dtypes, budget_s=budget,
                               progress=progress, measurer=measurer)
        what = "the sweep grid"
    if device.type == "cpu":   # the host's cold-start cost (kernels_db/host_overheads.py)
        from boomfx.kernels_db.host_overheads import collect_host_costs
        collect_host_costs(Store(path), measurer, compiled=bool(args.compile))
    print(f"collected {what} into {path}: measured {result.measured}, already present {result.skipped}, "
          f"failed {len(result.failed)}, refused as implausible {len(result.rejected)}, left for later "
          f"{result.pending} ({result.elapsed_s:.1f} s)")
    for key, why in result.failed[:10]:
        print(f"  could not measure {key.op}: {why}", file=sys.stderr)
    for rejection in result.rejected:   # kernels_db/plausibility.py
        print(f"  refused {rejection.key.op} {_sizes(rejection.key)}: {rejection.reason}", file=sys.stderr)
    warning = noisy_measurements_warning(path, result.measured_keys)
    if warning:
        print(warning, file=sys.stderr)
    if result.rejected:   # like kernels left for later: the file holds only plausible rows, a rerun adds the rest
        print(f"boomfx: {len(result.rejected)} measurements refused as implausible and not stored: collect again "
              f"with --threads 1 (its clock excludes the time other jobs run) or on a quieter machine; a rerun "
              f"measures only what is missing", file=sys.stderr)
    return 0


def _parallel(args: argparse.Namespace) -> Any:
    """The ``--parallel`` plan of a collection (``--for`` only, eager, no ``--rank``), else None."""
    from boomfx.distributed.cli import parallel_config
    if args.rank is not None:
        raise OptionError("--rank: kernels collect --parallel measures every rank class's kernels")
    cfg = parallel_config(args)
    if cfg is not None and (not args.for_file or args.blocks or args.compile or args.collectives):
        raise OptionError("--parallel needs --for FILE.pt2 (eager: no --blocks, --compile or --collectives)")
    return cfg


def _rank_class_calls(program: Any, cfg: Any, spec: Any, bindings: Any) -> list[tuple[list, list]]:
    """Each rank class's aten kernels under ``cfg`` (collectives and sends are priced apart), with their
    operands (``Analysis.kernel_operands``)."""
    from boomfx.analysis.analysis import AnalyzeOptions
    from boomfx.distributed.analysis import DistributedAnalysis
    dist = DistributedAnalysis(program, cfg, spec, AnalyzeOptions(spec.name, db="none"))
    rank_bindings = dist.program_bindings(bindings)
    out = []
    for a in dist.analyses:
        pairs = [(c, o) for c, o in zip(a.kernel_calls(rank_bindings), a.kernel_operands()) if c.op.namespace == "aten"]
        out.append(([c for c, _ in pairs], [o for _, o in pairs]))
    return out


def _in_step(path: Path, calls: list, measurer: Any, operands: Optional[list] = None) -> str:
    """Time the program's kernels inside its step and price them by it (kernels_db/in_step.py), at the
    thread count set above; with ``operands``, each call handed the tensors the step's earlier calls left."""
    from boomfx.kernels_db.in_step import collect_in_step
    from boomfx.kernels_db.store import Store
    return f" ({collect_in_step(Store(path), calls, measurer, operands)} timed in step)"


def _sizes(key) -> str:
    return "x".join(",".join(str(s) for s in t["shape"]) or "()" for t in key.data["tensors"][:3])


NOISY_SPREAD = 3.0      # p90 / median above which a kernel's samples disagree
NOISY_SHARE = 0.2       # share of a collection's kernels that may be noisy before the user is told


def noisy_measurements_warning(path: Path, key_hashes: tuple[str, ...]) -> Optional[str]:
    """One line when many kernels just measured have a p90 far above their median.

    Why: on a machine shared with other jobs, worker threads of a parallel region get descheduled and a
    kernel's samples scatter (seen on a loaded 2-vCPU VM: microsecond matmuls at 6 ms with 2 threads).
    Such a database silently over-predicts; the fix is ``--threads 1`` or a quieter machine.
    """
    from boomfx.kernels_db.store import Store
    if not key_hashes:
        return None
    wanted = set(key_hashes)
    with Store(path) as store:
        rows = [r for r in store.records() if r.key.key_hash in wanted and r.median_ns > 0]
    noisy = [r for r in rows if r.p90_ns > NOISY_SPREAD * r.median_ns]
    if not rows or len(noisy) <= NOISY_SHARE * len(rows):
        return None
    return (f"warning: {len(noisy)} of {len(rows)} kernels measured with p90 > {NOISY_SPREAD:.0f}x their median "
            f"(threads={torch.get_num_threads()}): other jobs are competing for this machine's cores; "
            f"measure with --threads 1 or on a quieter machine")


def _import(args: argparse.Namespace) -> int:
    from boomfx.kernels_db.store import Store
    source = Path(args.path)
    if not source.exists():
        raise OptionError(f"nothing to import at {source}")
    if source.is_file():
        from boomfx.cli.collectives import try_import   # nccl-tests tables, the public NCCL table
        done = try_import(source, args, _db_path)
        if done is not None:
            return done
        if not args.db:
            raise OptionError("importing a boomfx CSV needs --db PATH (the database to add it to)")
        with Store(args.db) as store:
            res = store.import_csv(source)
        print(f"imported {source} into {args.db}: {res}")
        return 0
    from boomfx.kernels_db.public_data import iter_public_rows, public_record, to_opcall
    by_device: dict[str, list] = {}
    for row in iter_public_rows(source):
        if args.device and row.device != args.device:
            continue
        by_device.setdefault(row.device, []).append(public_record(row, to_opcall(row)))
    if not by_device:
        raise OptionError(f"no public measurements found under {source}" +
                          (f" for device {args.device}" if args.device else ""))
    for device, records in sorted(by_device.items()):
        path = _db_path(args.db, device)
        path.parent.mkdir(parents=True, exist_ok=True)
        with Store(path) as store:
            n = store.put_many(records, replace=False)   # re-import adds nothing
        print(f"{device}: {n} new rows of {len(records)} in {path}")
    return 0


def _existing_store(db: str):
    """The Store at ``db``, which must exist (export and info never create one)."""
    from boomfx.kernels_db.store import Store
    if not Path(db).exists():
        raise OptionError(f"no kernel database at {db}")
    return Store(db)


def _export(args: argparse.Namespace) -> int:
    with _existing_store(args.db) as store:
        n = store.export_csv(args.path)
    print(f"exported {n} rows of {args.db} to {args.path}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from boomfx.kernels_db.device_rows import devices_in
    with _existing_store(args.db) as store:
        held = devices_in(store)
        print(f"{args.db}: {store.count()} rows of {len(held)} device{'s' if len(held) != 1 else ''}"
              + (" (each device is priced only by its own rows)" if len(held) > 1 else ""))
        for d in held:
            print(f"  {d.device_name} ({d.device_kind}): {d.rows} rows, {d.fingerprints} fingerprint"
                  f"{'s' if d.fingerprints != 1 else ''}")
        for fp in store.fingerprints():
            ops = Counter(rec.key.op for rec in store.records(fp))
            sources = Counter(rec.source for rec in store.records(fp))
            print(f"{fp.device_name} ({fp.device_kind}, torch {fp.torch_version}, {fp.host}): "
                  f"{sum(ops.values())} kernels; sources: {dict(sources)}")
            for op, n in ops.most_common(12):
                print(f"  {op}: {n}")
    return 0
