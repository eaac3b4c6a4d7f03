"""PyTorch's CUDA caching allocator, modelled: its configuration, accounting, policy, event replay, and the
memory that lives outside it."""
