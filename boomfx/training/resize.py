"""``F.interpolate``/``nn.Upsample`` re-traced with a symbolic batch.

An export records interpolation as the ``.vec`` overload of ``aten.upsample_*`` (output size or scale factors).
Its C++ composite reads the input's sizes as ints (``aten::size``), which fixes a symbolic batch to the
example's: every ``--train`` of a model with an interpolation was refused. ``run_resize`` calls the
``.default`` overload the composite would, with the output size computed here on SymInts as ATen's
``compute_output_size`` does (the given size, or each spatial size times its scale, truncated) and the scales
passed through only when they were given; the op stays one kernel, with its own backward, as eager runs it.
(``training/fake_kernels.py`` gives the ``.default`` ops and their backwards shapes on SymInts.)
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from boomfx.training.fake_kernels import named_args

aten = torch.ops.aten

# .vec overload -> (.default overload, takes align_corners)
RESIZE_OPS = {
    aten.upsample_nearest1d.vec: (aten.upsample_nearest1d.default, False),
    aten.upsample_nearest2d.vec: (aten.upsample_nearest2d.default, False),
    aten.upsample_nearest3d.vec: (aten.upsample_nearest3d.default, False),
    aten._upsample_nearest_exact2d.vec: (aten._upsample_nearest_exact2d.default, False),
    aten.upsample_linear1d.vec: (aten.upsample_linear1d.default, True),
    aten.upsample_bilinear2d.vec: (aten.upsample_bilinear2d.default, True),
    aten.upsample_bicubic2d.vec: (aten.upsample_bicubic2d.default, True),
    aten.upsample_trilinear3d.vec: (aten.upsample_trilinear3d.default, True),
}


def run_resize(target: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``target`` (a ``.vec`` overload of ``RESIZE_OPS``) as its ``.default`` call."""
    default, has_align = RESIZE_OPS[target]
    values = named_args(target, args, kwargs)
    x = values["input"]
    spatial = x.dim() - 2
    scales = values.get("scale_factors")
    size = values.get("output_size")
    if size is None:
        size = [torch.sym_int(x.shape[2 + i] * float(scales[i])) for i in range(spatial)]
    per_dim = list(scales) if scales is not None else [None] * spatial
    extra = [values["align_corners"]] if has_align else []
    return default(x, list(size), *extra, *per_dim)
