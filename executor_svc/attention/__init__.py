"""Attention backends: torch (CPU and reference) and CuPy kernels (CUDA)."""
