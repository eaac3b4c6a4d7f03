"""The per-point evaluation: bind sizes, price kernels, schedule host terms, build memory events and the Report."""
