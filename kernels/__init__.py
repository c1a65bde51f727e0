"""Triton kernels and their PyTorch references (the systems half: packed paged latent cache)."""
