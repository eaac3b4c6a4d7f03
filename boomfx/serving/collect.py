"""``boomfx serve --collect``: measure, on this machine, every kernel the report's steps price.

A serving step is not the export at its example sizes: token-wise nodes run at the step's token count,
attention over each sequence's cached context, the KV-cache writes and the sampler are calls of their
own (``StepPricer.kernel_calls``). ``boomfx kernels collect --for`` measures the export's own calls,
not these; this collects exactly the calls of the prefill chunks and decode batches the report
prices (and the ``--sweep`` grid), with the protocol ``kernels collect`` uses
(``kernels_db.measure.protocol_measurer``), then on a CPU the host's eager costs and each step's
kernels timed where they stand in that step (``kernels_db/in_step.py``), as ``kernels collect --for``
does (the CLI then measures transformers' Python per module call under ``--kv-write concat``:
``host_overhead.py``). The workload simulation prices steps between these by interpolation from their rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from boomfx.core.devices import DeviceSpec
from boomfx.core.errors import OptionError
from boomfx.serving.steps import Step, StepPricer


@dataclass(frozen=True)
class ServingCollection:
    """What one ``--collect`` measured (the database's own counts)."""

    path: Path
    calls: int
    measured: int
    present: int
    failed: int
    in_step_rows: int
    seconds: float
    refused: tuple[str, ...] = ()     # key hashes refused as implausible (kernels_db/plausibility.py): not stored

    def describe(self) -> str:
        text = (f"collected {self.calls} kernels of the serving steps into {self.path}: measured {self.measured}, "
                f"already present {self.present}, failed {self.failed}, timed in step {self.in_step_rows} "
                f"({self.seconds:.1f} s)")
        if self.refused:
            text += (f"; {len(self.refused)} refused as implausible (a busy host?) and priced by the model: "
                     "collect again on a quieter machine")
        return text


def local_device(target: DeviceSpec) -> torch.device:
    """The device of this machine that measures for ``target``: its CPU for a CPU target, a CUDA GPU for
    a GPU target (refused without one: its prices would not be that GPU's)."""
    if target.kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise OptionError(f"--collect measures on this machine: --device {target.name} needs its GPU here "
                          "(collect on the GPU, or serve --device cpu)")
    return torch.device("cuda")


def collect_serving(pricer: StepPricer, steps: Sequence[Step], path: Path, target: DeviceSpec,
                    in_step: bool = True) -> ServingCollection:
    """Measure every call of ``steps`` (as ``pricer`` prices them) into the database at ``path``."""
    import time

    from boomfx.kernels_db.collect import collect_calls
    from boomfx.kernels_db.measure import protocol_measurer
    from boomfx.kernels_db.store import Store
    device = local_device(target)
    t0 = time.perf_counter()
    per_step = [pricer.kernel_calls(step) for step in steps]
    calls = [c for step_calls in per_step for c in step_calls]
    path.parent.mkdir(parents=True, exist_ok=True)
    measurer = protocol_measurer(device)
    result = collect_calls(Store(path), calls, device, measurer=measurer)
    rows = 0
    if device.type == "cpu":
        from boomfx.kernels_db.host_overheads import collect_host_costs
        from boomfx.kernels_db.in_step import collect_in_step
        collect_host_costs(Store(path), measurer, compiled=False)
        if in_step and not result.pending:
            rows = sum(collect_in_step(Store(path), step_calls, measurer) for step_calls in per_step)
    return ServingCollection(path, len(calls), result.measured, result.skipped, len(result.failed), rows,
                             time.perf_counter() - t0, tuple(r.key.key_hash for r in result.rejected))
