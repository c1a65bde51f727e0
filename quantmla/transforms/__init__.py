"""Equivalent cache transforms (content and RoPE paths) and their offline fusion into weights."""

from quantmla.transforms.core import (
    ContentTransform,
    LayerTransforms,
    RopeTransform,
    cayley,
    hadamard,
    latent_magnitude,
    pair_indices,
    pair_matrix,
)
from quantmla.transforms.fusion import fuse_content, fuse_rope

__all__ = [
    "ContentTransform",
    "LayerTransforms",
    "RopeTransform",
    "cayley",
    "fuse_content",
    "fuse_rope",
    "hadamard",
    "latent_magnitude",
    "pair_indices",
    "pair_matrix",
]
