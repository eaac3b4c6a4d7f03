"""Per-aten-op cost formulas (FLOPs, bytes read, bytes written), one module per op family."""
from boomfx.passes.costs.registry import (
    ZERO, Cost, CostRegistry, OpCall, PricedCall, default_registry, fallback_cost, price_call, register_cost,
)

__all__ = ["ZERO", "Cost", "CostRegistry", "OpCall", "PricedCall", "default_registry", "fallback_cost",
           "price_call", "register_cost"]
