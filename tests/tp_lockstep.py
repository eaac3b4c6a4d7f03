"""Run one TP rank graph per thread, in lockstep, on real weights: the numerical check of a TP rewrite.

``tensor_parallel.shard_export`` rewrites a forward export into what every rank of a TP group runs.
Its shapes alone cannot show that a rank holds the *right* rows (a contiguous half of a fused
q|k|v weight has the same shape as a q/k/v-per-part half, and gives wrong attention). Here each of
``tp`` threads runs the rank graph with its own slices of the export's real weights, cut by hand from
the test's own description of the layout, and the TP custom ops do what the collectives do across
the threads (``all_reduce``: the sum of every rank's tensor, in rank order; ``all_gather``: the
concatenation); the ranks' outputs must equal the unsharded export's.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

TP_OPS = torch.ops.boomfx_tp


class _Group:
    """The threads' collectives: every rank hands in its tensor and gets back all of them."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _Rank(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, rank: int, group: _Group) -> None:
        super().__init__(gm)
        self.rank, self.group = rank, group

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if target is TP_OPS.region_enter.default:
            return args[0]
        if target is TP_OPS.all_reduce.default:
            parts = self.group.exchange(self.rank, args[0])
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            return total
        if target is TP_OPS.all_gather.default:
            return torch.cat(self.group.exchange(self.rank, args[0]), dim=args[1])
        if getattr(target, "namespace", None) == "boomfx_tp":
            raise NotImplementedError(f"{target} is not emulated")
        return super().call_function(target, args, kwargs)


def local_slice(value: torch.Tensor, dim: int, parts: Sequence[int], rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``value`` on ``dim``: its 1/world block of each part, side by side."""
    return torch.cat([p.chunk(world, dim)[rank] for p in value.split(list(parts), dim)], dim)


def plain_layout(plan: dict[str, str]) -> Callable[[str, torch.Tensor], tuple[int, Sequence[int]] | None]:
    """``run_ranks``'s layout for a plan of plain splits: colwise weights (and biases) on their output
    features, rowwise weights on their input features, rowwise biases whole."""
    def layout(fqn: str, value: torch.Tensor) -> tuple[int, Sequence[int]] | None:
        style = plan.get(fqn)
        if style is None or (style == "rowwise" and value.dim() == 1):
            return None
        dim = 0 if style == "colwise" else 1
        return dim, [value.shape[dim]]
    return layout


def run_ranks(sharded: Any, ep: torch.export.ExportedProgram, world: int,
              layout: Callable[[str, torch.Tensor], tuple[int, Sequence[int]] | None],
              inputs: Sequence[torch.Tensor]) -> list[Any]:
    """Every rank's outputs of ``sharded`` (a ``shard_export`` result of ``ep``). ``layout(fqn, value)``:
    (split dim, part sizes) of a planned parameter, None for a whole one; ``inputs``: the user inputs, in order."""
    from torch.export.graph_signature import InputKind

    state = {**ep.state_dict, **ep.constants}
    whole: list[Any] = []
    user = iter(inputs)
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            whole.append((None, next(user)))
        else:
            whole.append((spec.target, state[spec.target]))
    group = _Group(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def go(rank: int) -> None:
        args = []
        for fqn, value in whole:
            how = layout(fqn, value) if fqn is not None and spec_is_param(ep, fqn) else None
            args.append(value if how is None else local_slice(value, how[0], how[1], rank, world))
        try:
            with torch.no_grad():
                results[rank] = _Rank(sharded.graph_module, rank, group).run(*args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def spec_is_param(ep: torch.export.ExportedProgram, fqn: str) -> bool:
    return fqn in ep.graph_signature.inputs_to_parameters.values()
