"""Triton kernels of fast, one file per pipeline stage: launchers on top, `_..._kernel` functions below."""
