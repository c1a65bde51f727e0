"""Path-isolated quantization in transformed coordinates, and the calibration objectives (docs/method.md §3–4).

Everything here is the *unfused* functional form of a transformed model: the content cache is
z = u R_C S_C with u = c Γ⁻¹ and the consumers see ĉ = Q(z) S_C⁻¹ R_Cᵀ Γ; the RoPE cache is
Q(k_R M_K) scored by q_R M_Q. With quantization off this is the original computation, and it is
what the fused model computes (fusion equivalence is tested separately).
"""

from __future__ import annotations

import torch

from quantmla.attention import attention_output, causal_regions
from quantmla.metrics import ENERGY_FLOOR
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


def positional_qk_loss(q_hat, k_hat, q_rot, k_rot) -> torch.Tensor:
    """Σ_{h, j ≤ t} (Q̃ K̂ᵀ − Q Kᵀ)² / max(Σ (Q Kᵀ)², 1e-8): the full positional score matrix."""
    n = q_rot.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q_rot.device).tril()
    teacher = torch.einsum("bhnr,btr->bhnt", q_rot.float(), k_rot.float())
    student = torch.einsum("bhnr,btr->bhnt", q_hat.float(), k_hat.float())
    err = (student - teacher).pow(2).masked_fill(~causal, 0).sum()
    return err / teacher.pow(2).masked_fill(~causal, 0).sum().clamp_min(ENERGY_FLOOR)


def layer_output(module, adapter, proj, c=None, q_rot=None, k_rot=None) -> torch.Tensor:
    """Post-o_proj attention output of one layer over a whole sequence, with optional replacements."""
    c = proj.c if c is None else c
    q_rot = proj.q_rot if q_rot is None else q_rot
    k_rot = proj.k_rot if k_rot is None else k_rot
    return attention_output(
        module, adapter, proj.q_nope, q_rot, causal_regions(c, k_rot), form="expanded"
    )
