"""Per-aten-op cost formulas (FLOPs, bytes read, bytes written), one module per op family."""
from boomfx.passes.costs.registry import (  # noqa: F401
    Cost, CostRegistry, OpCall, PricedCall, ZERO, default_registry, fallback_cost, price_call, register_cost,
)
