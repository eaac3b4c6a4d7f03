"""Analysis passes over a captured program: shapes/costs, blocks, kernels, liveness, and the compiled-mode
rewrites (layout, post-grad, fusion). Each pass is a function of the Program (and the AnalysisManager) that
returns a frozen result; this layer imports only ``boomfx.core``.

The FX pass that writes predictions into ``node.meta`` sits above the driver: ``boomfx.annotate``
(boomfx/integrations/annotate.py).
"""
