"""Convolution family sweep: ResNet/MobileNet-style 2-D convolutions (``aten.convolution``).

Shapes follow the stages of common CNNs: a 7x7/2 stem, 3x3 and 1x1 convs at 56..7 px with 64..512
channels, and depthwise 3x3 (groups = channels). Batch sizes differ by grid.
"""

from __future__ import annotations

from typing import Sequence

import torch

from boomfx.kernels_db.collectors import Config, build_call, check_grid, spec
from boomfx.passes.costs.registry import OpCall

aten = torch.ops.aten

# (in_channels, out_channels, spatial, kernel, stride, padding, groups)
_STAGES = [
    (3, 64, 224, 7, 2, 3, 1),
    (64, 64, 56, 3, 1, 1, 1),
    (64, 256, 56, 1, 1, 0, 1),
    (128, 128, 28, 3, 1, 1, 1),
    (128, 512, 28, 1, 1, 0, 1),
    (256, 256, 14, 3, 1, 1, 1),
    (256, 1024, 14, 1, 1, 0, 1),
    (512, 512, 7, 3, 1, 1, 1),
    (512, 2048, 7, 1, 1, 0, 1),
    (96, 96, 56, 3, 1, 1, 96),
    (192, 192, 28, 3, 1, 1, 192),
]
_BATCHES = {"tiny": [1], "small": [1, 4], "large": [1, 8, 32, 64]}


def configs(dtypes: Sequence[torch.dtype], grid: str = "small") -> list[Config]:
    check_grid(grid)
    stages = _STAGES if grid != "tiny" else [(8, 16, 16, 3, 1, 1, 1)]
    out: list[Config] = []
    for dtype in dtypes:
        for batch in _BATCHES[grid]:
            for cin, cout, hw, k, stride, pad, groups in stages:
                out.append(
                    {
                        "batch": batch,
                        "cin": cin,
                        "cout": cout,
                        "hw": hw,
                        "k": k,
                        "stride": stride,
                        "pad": pad,
                        "groups": groups,
                        "dtype": dtype,
                    }
                )
    return out


def make_call(config: Config) -> OpCall:
    dtype, groups, k = config["dtype"], config["groups"], config["k"]
    x = spec((config["batch"], config["cin"], config["hw"], config["hw"]), dtype)
    w = spec((config["cout"], config["cin"] // groups, k, k), dtype)
    stride, pad = config["stride"], config["pad"]
    return build_call(
        aten.convolution.default, (x, w, None, [stride, stride], [pad, pad], [1, 1], False, [0, 0], groups)
    )
