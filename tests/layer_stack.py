"""A two-layer stack of one test block under ``layers`` (the layer list the TP walk and the pipeline split
look for), exported with dynamic batch and sequence: the small models of the TP refusal tests."""
from __future__ import annotations

from typing import Callable

import torch
from torch.export import Dim


class LayerStack(torch.nn.Module):
    def __init__(self, make_layer: Callable[[], torch.nn.Module], layers: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(make_layer() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def export_stack(make_layer: Callable[[], torch.nn.Module], width: int) -> torch.export.ExportedProgram:
    """``LayerStack(make_layer)`` exported on a [2, 8, width] input, batch and sequence dynamic."""
    torch.manual_seed(0)
    dims = {"x": {0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)}}
    return torch.export.export(LayerStack(make_layer), (torch.randn(2, 8, width),), dynamic_shapes=dims, strict=False)
