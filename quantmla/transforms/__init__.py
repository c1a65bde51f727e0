"""Equivalent cache transforms (content and RoPE paths) and their offline fusion into weights."""

from quantmla.transforms.core import (
    ContentTransform,
    LayerTransforms,
    RopeTransform,
    cached_rope_matrices,
    cayley,
    hadamard,
    latent_magnitude,
    online_rope_matrix,
    pair_indices,
    pair_matrix,
)
from quantmla.transforms.fusion import fuse_content, fuse_rope

__all__ = [
    "ContentTransform",
    "LayerTransforms",
    "RopeTransform",
    "cached_rope_matrices",
    "cayley",
    "fuse_content",
    "fuse_rope",
    "hadamard",
    "latent_magnitude",
    "online_rope_matrix",
    "pair_indices",
    "pair_matrix",
]
