"""The scheduler: the host thread that issues kernels and the device streams that run them -> a Timeline."""
