"""Equivalent transforms of the two MLA cache paths (docs/method.md §3), as plain tensors.

Content path: cache `z_C = u R_C S_C` (u the weightless-normalised latent, R_C orthogonal,
S_C = diag(s_C) > 0); every consumer W of the native cache c = uΓ becomes W Γ R_C S_C⁻¹ (as a
(out, in) Linear weight), so z_C W̃ᵀ = c Wᵀ exactly. Every method's s_C starts at the latent's own
magnitude (`latent_magnitude`), not at u's: the formats without a scale that follows the values
(vLLM's `fp8` and `nvfp4_ds_mla`, tensor scale 1.0) see the cache at the model's magnitude.
RoPE path: per frequency pair i a rotation R_i ∈ SO(2) (angle θ_i) and a scale s_i; key
k_R R_P S_P and query q_R R_P S_P⁻¹ leave every positional score unchanged and commute with the
positional rotation of the same pair, so both fold into the pre-RoPE projections.
Pairs follow the model's layout: "interleaved" (2i, 2i+1) or "half" (i, i + d/2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantmla.errors import ConfigError

PAIR_LAYOUTS = ("interleaved", "half")


def pair_indices(dim: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinates (a_i, b_i) of frequency pair i under a layout."""
    if layout == "interleaved":
        return torch.arange(0, dim, 2), torch.arange(1, dim, 2)
    if layout == "half":
        return torch.arange(dim // 2), torch.arange(dim // 2, dim)
    raise ConfigError("pair layout", layout, PAIR_LAYOUTS)


def pair_matrix(angles: torch.Tensor, scales: torch.Tensor, layout: str) -> torch.Tensor:
    """(d, d) matrix M with row-vector action x ↦ x M: pair i rotated by angle θ_i and scaled by s_i.

    The rotation has the form of RoPE's own: (a, b) ↦ (a cos θ − b sin θ, a sin θ + b cos θ).
    """
    dim = 2 * angles.numel()
    a, b = pair_indices(dim, layout)
    cos, sin = torch.cos(angles) * scales, torch.sin(angles) * scales
    m = angles.new_zeros(dim, dim)
    m = m.index_put((a, a), cos).index_put((b, b), cos)
    m = m.index_put((a, b), sin).index_put((b, a), -sin)
    return m


def cayley(params: torch.Tensor) -> torch.Tensor:
    """Orthogonal (I − A)(I + A)⁻¹ from a skew-symmetric A = P − Pᵀ; P = 0 gives the identity."""
    skew = params - params.transpose(-1, -2)
    eye = torch.eye(params.shape[-1], dtype=params.dtype, device=params.device)
    return torch.linalg.solve(eye + skew, eye - skew, left=False)


def latent_magnitude(gamma: torch.Tensor) -> float:
    """The power of two nearest the geometric mean of |Γ| (the latent norm's weight): the scale
    that keeps z_C = u R_C S_C at the magnitude of c = uΓ. A power of two, so that a format whose
    scales follow the values dequantizes exactly as at unit magnitude (only its range changes)."""
    return 2.0 ** round(gamma.detach().abs().double().log2().mean().item())


def hadamard(dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix (orthonormal, symmetric); dim must be a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ConfigError("hadamard dim", dim, "a power of two")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


@dataclass
class ContentTransform:
    """R_C (d_c, d_c) orthogonal and s_C (d_c,) > 0, in weightless-normalised coordinates."""

    rotation: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def identity(cls, d_c: int, dtype=torch.float64) -> ContentTransform:
        return cls(torch.eye(d_c, dtype=dtype), torch.ones(d_c, dtype=dtype))


@dataclass
class RopeTransform:
    """Per-pair angles θ (d_r/2,) and scales s (d_r/2,) > 0; `layout` is the pre-RoPE pair layout."""

    angles: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def identity(cls, d_r: int, dtype=torch.float64) -> RopeTransform:
        return cls(torch.zeros(d_r // 2, dtype=dtype), torch.ones(d_r // 2, dtype=dtype))

    def key_matrix(self, layout: str) -> torch.Tensor:
        """R_P S_P: the cached key is k_R R_P S_P."""
        return pair_matrix(self.angles, self.scales, layout)

    def query_matrix(self, layout: str) -> torch.Tensor:
        """R_P S_P⁻¹: the compensated query."""
        return pair_matrix(self.angles, 1.0 / self.scales, layout)


def online_rope_matrix(rope_online: str | None, d_r: int) -> torch.Tensor | None:
    """The matrix a method runs online on the post-RoPE query and key (float64): "hadamard" (QuaRot†'s
    H_P; QuantMLA's and SmoothQuant†'s with `rope_hadamard`), None when nothing runs online."""
    if rope_online is None:
        return None
    if rope_online != "hadamard":
        raise ConfigError("rope_online", rope_online, "hadamard or none")
    return hadamard(d_r)


def cached_rope_matrices(
    transform: RopeTransform, layout: str, online: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M_K, M_Q) as the cache sees them: the fused per-pair transform, then the online matrix if
    any (orthogonal, so M_Q M_Kᵀ = I still holds)."""
    key, query = transform.key_matrix(layout), transform.query_matrix(layout)
    if online is None:
        return key, query
    online = online.to(key)
    return key @ online, query @ online


@dataclass
class LayerTransforms:
    """One MLA layer's transforms; None leaves that path in native coordinates."""

    content: ContentTransform | None = None
    rope: RopeTransform | None = None
