"""Path-isolated quantization in transformed coordinates, and the calibration objectives (docs/method.md §3–4).

Everything here is the *unfused* functional form of a transformed model: the content cache is
z = u R_C S_C with u = c Γ⁻¹ and the consumers see ĉ = Q(z) S_C⁻¹ R_Cᵀ Γ; the RoPE cache is
Q(k_R M_K) scored by q_R M_Q. With quantization off this is the original computation, and it is
what the fused model computes (fusion equivalence is tested separately).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantmla.attention import attention_output, causal_regions
from quantmla.metrics import ENERGY_FLOOR, nmse
from quantmla.quant import qdq_content, qdq_rope
from quantmla.spec import UNQUANTIZED_BITS, QuantizerSpec


def content_qdq(c, gamma, rotation, scale, spec: QuantizerSpec, ste: bool = False) -> torch.Tensor:
    """ĉ = Q(c Γ⁻¹ R S) S⁻¹ Rᵀ Γ: the native-coordinate view of the quantized transformed cache."""
    if spec.content_bits >= UNQUANTIZED_BITS:
        return c
    z_hat = qdq_content(spec, ((c / gamma) @ rotation) * scale, ste=ste)
    return ((z_hat / scale) @ rotation.transpose(-1, -2)) * gamma


def rope_qdq(q_rot, k_rot, key_matrix, query_matrix, spec: QuantizerSpec, ste: bool = False):
    """(q_R M_Q, Q(k_R M_K)); matrices in the *cache* pair layout (post-RoPE)."""
    if spec.rope_bits >= UNQUANTIZED_BITS:
        return q_rot, k_rot
    return q_rot @ query_matrix, qdq_rope(spec, k_rot @ key_matrix, ste=ste)


def causal_score_energy(a: torch.Tensor, b: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Σ over heads and causal pairs j ≤ t of (a_t · b_j)², a (B, H, n, r), b (B, n, r), without the
    (n, n) score matrix: each block of queries meets all earlier keys through their Gram matrix
    Σ b_j b_jᵀ (n·r² work), its own block directly."""
    work = torch.promote_types(a.dtype, torch.float32)
    heads, pad = a.shape[1], -a.shape[-2] % block  # zero rows add nothing
    b = F.pad(b.to(work), (0, 0, 0, pad)).unflatten(-2, (-1, block))  # (B, blocks, m, r)
    a = F.pad(a.to(work), (0, 0, 0, pad)).unflatten(-2, (-1, block))  # (B, H, blocks, m, r)
    a = a.transpose(1, 2).flatten(2, 3)  # (B, blocks, H·m, r): every head's queries of a block
    gram = (b.transpose(-1, -2) @ b).cumsum(1)  # keys of blocks ≤ k
    earlier = torch.cat([torch.zeros_like(gram[:, :1]), gram[:, :-1]], 1)
    across = ((a @ earlier) * a).sum()
    within = (a @ b.transpose(-1, -2)).unflatten(2, (heads, block))  # (B, blocks, H, m, m)
    causal = torch.ones(block, block, dtype=torch.bool, device=a.device).tril()
    return across + within.pow(2).masked_fill(~causal, 0).sum()


def positional_qk_loss(q_rot, k_rot, key_matrix, query_matrix, spec: QuantizerSpec, ste=False):
    """Σ_{h, j ≤ t} (Q̃ K̂ᵀ − Q Kᵀ)² / max(Σ_{h, j ≤ t} (Q Kᵀ)², floor) over the full causal positional
    score matrix, Q̃ = Q M_Q and K̂ = Q(K M_K). As M_Q M_Kᵀ = I, the error is Q̃ (K̂ − K M_K)ᵀ: the
    transformed key's quantization error scored by the transformed query (the same function of the
    transforms, so the same value and gradient), summed in O(n·d_r²) by `causal_score_energy`."""
    if spec.rope_bits >= UNQUANTIZED_BITS:
        return q_rot.new_zeros(())
    q_hat, k_hat = rope_qdq(q_rot, k_rot, key_matrix, query_matrix, spec, ste)
    error = causal_score_energy(q_hat, k_hat - k_rot @ key_matrix)
    with torch.no_grad():
        energy = causal_score_energy(q_rot, k_rot)
    return error / energy.clamp_min(ENERGY_FLOOR)


def positional_output_loss(
    module, adapter, proj, teacher, key_matrix, query_matrix, spec, ste=False
):
    """Normalised post-`o_proj` output MSE with the RoPE path alone quantized (content exact): the
    content objective's target for the RoPE path (`rope_objective=output`); the α search's own
    criterion."""
    if spec.rope_bits >= UNQUANTIZED_BITS:
        return proj.k_rot.new_zeros(())
    q_hat, k_hat = rope_qdq(proj.q_rot, proj.k_rot, key_matrix, query_matrix, spec, ste)
    return nmse(layer_output(module, adapter, proj, q_rot=q_hat, k_rot=k_hat), teacher)


def layer_output(module, adapter, proj, c=None, q_rot=None, k_rot=None) -> torch.Tensor:
    """Post-o_proj attention output of one layer over a whole sequence, with optional replacements."""
    c = proj.c if c is None else c
    q_rot = proj.q_rot if q_rot is None else q_rot
    k_rot = proj.k_rot if k_rot is None else k_rot
    return attention_output(
        module, adapter, proj.q_nope, q_rot, causal_regions(c, k_rot), form="expanded"
    )
