"""fast's CPU kernels: Numba-compiled loops over CPU tensors' memory (the path when Triton is not in use)."""

from fast.cpu.threads import load_tbb

load_tbb()  # before any of these kernels' first parallel launch fixes Numba's threading layer (fast.cpu.threads)
