"""Offline fusion of the content and RoPE transforms into an MLA module's own weights (docs/method.md §3).

All edits are computed in float64 and written back in the weights' dtype. After fusion no
transform runs online: the module's unpatched forward computes the same function (up to rounding)
while its cache holds z_C = u R_C S_C and k_R R_P S_P.
"""

from __future__ import annotations

import torch
from torch import nn

from quantmla.models.adapters import MLAAdapter
from quantmla.transforms.core import ContentTransform, RopeTransform


def _write(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))


@torch.no_grad()
def fuse_content(module: nn.Module, adapter: MLAAdapter, t: ContentTransform) -> None:
    """W_DKV content rows ← R_Cᵀ W; norm weight ← s_C; kv_b_proj ← W Γ R_C S_C⁻¹."""
    d_c = module.kv_lora_rank
    rot, scale = t.rotation.double(), t.scale.double()
    kv_a = module.kv_a_proj_with_mqa
    _write(kv_a.weight[:d_c], rot.T @ kv_a.weight[:d_c].double())
    if kv_a.bias is not None:
        _write(kv_a.bias[:d_c], kv_a.bias[:d_c].double() @ rot)
    gamma = module.kv_a_layernorm.weight.double().clone()  # .double() aliases a float64 weight
    _write(module.kv_a_layernorm.weight, scale)
    w = module.kv_b_proj.weight.double()
    _write(module.kv_b_proj.weight, (w * gamma) @ rot / scale)


@torch.no_grad()
def fuse_rope(module: nn.Module, adapter: MLAAdapter, t: RopeTransform) -> None:
    """Pre-RoPE key rows ← (R_P S_P)ᵀ W_KR; every head's pre-RoPE query rows ← (R_P S_P⁻¹)ᵀ W_QR,h."""
    layout = adapter.geometry(module).weight_pairs
    d_c = module.kv_lora_rank
    key_m, query_m = t.key_matrix(layout).double(), t.query_matrix(layout).double()
    kv_a = module.kv_a_proj_with_mqa
    _write(kv_a.weight[d_c:], key_m.T @ kv_a.weight[d_c:].double())
    if kv_a.bias is not None:
        _write(kv_a.bias[d_c:], kv_a.bias[d_c:].double() @ key_m)
    q = adapter.query_output_projection(module)
    rows = q.weight.view(module.num_heads, module.qk_head_dim, -1)[:, module.qk_nope_head_dim :]
    _write(rows, torch.einsum("rs,hri->hsi", query_m, rows.double()))
    if q.bias is not None:
        bias = q.bias.view(module.num_heads, module.qk_head_dim)[:, module.qk_nope_head_dim :]
        _write(bias, bias.double() @ query_m)
