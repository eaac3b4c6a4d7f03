"""Distributed training: parallel configurations, per-rank programs and per-rank memory.

``plan.ParallelConfig`` says how a step is parallelised; ``rank_programs`` rewrites the training
program into what each distinct rank runs (sharded parameters, gradients and optimizer state, and
the collectives as ``torch.ops._c10d_functional`` nodes); ``analysis`` runs the usual liveness and
allocator replay on each and reports every rank class.
"""
