"""Analysis passes over a captured program: shapes/costs, blocks, kernels, liveness."""
