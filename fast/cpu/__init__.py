"""fast's CPU kernels: Numba-compiled loops over CPU tensors' memory (the path when Triton is not in use)."""
