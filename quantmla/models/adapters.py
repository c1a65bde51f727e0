"""Per-family MLA adapters, in a registry keyed by `config.model_type` (never by checkpoint name).

An adapter reads an installed transformers attention module and returns what MLA caches and what
attention needs: pre-RoPE-free content queries, post-RoPE positional queries, the content latent
`c = RMSNorm(x_c)·Γ` and the post-RoPE key `k_R`, exactly as the module's own forward computes them
(it calls the module's own sub-modules and the family's own RoPE function; nothing is copied).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from quantmla.errors import ConfigError

# Config `model_type`s that are loaded as another family's classes, without trust_remote_code.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class MLAGeometry:
    """Shapes and conventions of one MLA attention module."""

    d_c: int  # kv_lora_rank, the cached content latent width
    d_r: int  # qk_rope_head_dim, the cached RoPE key width
    d_nope: int
    d_v: int
    n_heads: int
    scaling: float  # softmax scale τ, YaRN mscale included
    weight_pairs: str  # RoPE pairs in the pre-RoPE projection rows: "interleaved" (2i,2i+1) or "half" (i,i+d_r/2)
    cache_pairs: str  # the same for the cached post-RoPE k_R


@dataclass
class MLAProjections:
    q_nope: torch.Tensor  # (B, H, n, d_nope)
    q_rot: torch.Tensor  # (B, H, n, d_r), post-RoPE
    c: torch.Tensor  # (B, n, d_c), the content latent as cached
    k_rot: torch.Tensor  # (B, n, d_r), post-RoPE, as cached


class MLAAdapter:
    """Base adapter: DeepSeek-style MLA with `q_proj` or `q_a_proj/q_a_layernorm/q_b_proj`."""

    model_types: ClassVar[tuple[str, ...]] = ()
    modeling_module: ClassVar[str] = ""
    attention_class_name: ClassVar[str] = ""

    @property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.modeling_module}")

    @property
    def attention_class(self) -> type[nn.Module]:
        return getattr(self.modeling, self.attention_class_name)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every MLA attention module of the model, in layer (cache index) order."""
        found = [m for m in model.modules() if isinstance(m, self.attention_class)]
        return sorted(found, key=lambda m: m.layer_idx)

    def geometry(self, module: nn.Module) -> MLAGeometry:
        pairs = self.weight_and_cache_pairs(module)
        return MLAGeometry(
            d_c=module.kv_lora_rank,
            d_r=module.qk_rope_head_dim,
            d_nope=module.qk_nope_head_dim,
            d_v=module.v_head_dim,
            n_heads=module.num_heads,
            scaling=float(module.scaling),
            weight_pairs=pairs[0],
            cache_pairs=pairs[1],
        )

    def weight_and_cache_pairs(self, module: nn.Module) -> tuple[str, str]:
        interleave = getattr(module.config, "rope_interleave", False)
        return ("interleaved", "half") if interleave else ("half", "half")

    def up_projections(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, d_nope, d_c) and W_UV (H, d_v, d_c): head slices of kv_b_proj, as views."""
        w = module.kv_b_proj.weight.view(
            module.num_heads, module.qk_nope_head_dim + module.v_head_dim, -1
        )
        return w[:, : module.qk_nope_head_dim], w[:, module.qk_nope_head_dim :]

    def query_output_projection(self, module: nn.Module) -> nn.Linear:
        """The Linear whose rows are the per-head queries (q_proj, or q_b_proj with q-LoRA)."""
        return module.q_proj if getattr(module, "q_lora_rank", None) is None else module.q_b_proj

    def queries(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(module, "q_lora_rank", None) is None:
            return module.q_proj(hidden)
        return module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden)))

    def project(
        self, module: nn.Module, hidden: torch.Tensor, position_embeddings
    ) -> MLAProjections:
        b, n, _ = hidden.shape
        q = self.queries(module, hidden).view(b, n, -1, module.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
        kv = module.kv_a_proj_with_mqa(hidden)
        x_c, k_rot = kv.split([module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
        c = module.kv_a_layernorm(x_c)
        q_nope, q_rot, c = self.scale_lora(module, q_nope, q_rot, c)
        q_rot, k_rot = self.rope(module, q_rot, k_rot.view(b, 1, n, -1), position_embeddings)
        return MLAProjections(q_nope, q_rot, c, k_rot.view(b, n, -1))

    def scale_lora(self, module, q_nope, q_rot, c):
        return q_nope, q_rot, c

    def rope(self, module, q_rot, k_rot, position_embeddings):
        cos, sin = position_embeddings
        if getattr(module.config, "rope_interleave", False):
            return self.modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        return self.modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)


class DeepseekV2Adapter(MLAAdapter):
    """DeepSeek-V2(-Lite): complex-number RoPE on interleaved pairs, kept interleaved in the cache."""

    model_types = ("deepseek_v2",)
    modeling_module = "deepseek_v2.modeling_deepseek_v2"
    attention_class_name = "DeepseekV2Attention"

    def weight_and_cache_pairs(self, module):
        return ("interleaved", "interleaved")

    def rope(self, module, q_rot, k_rot, position_embeddings):
        return self.modeling.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))


class DeepseekV3Adapter(MLAAdapter):
    """DeepSeek-V3/R1, Moonlight, Kimi-K2 (`kimi_k2` remapped): cos/sin RoPE, `rope_interleave` honoured."""

    model_types = ("deepseek_v3", "kimi_k2")
    modeling_module = "deepseek_v3.modeling_deepseek_v3"
    attention_class_name = "DeepseekV3Attention"


class Glm4MoeLiteAdapter(MLAAdapter):
    """GLM-4.7-Flash: DeepSeek-V3-style MLA with its own head dims (nope 192, v 256)."""

    model_types = ("glm4_moe_lite",)
    modeling_module = "glm4_moe_lite.modeling_glm4_moe_lite"
    attention_class_name = "Glm4MoeLiteAttention"


class LongcatFlashAdapter(MLAAdapter):
    """LongCat-Flash: two MLA blocks per decoder layer (cache indices 2l, 2l+1), `mla_scale_*` factors,
    always interleaved RoPE. The cached latent includes `mla_scale_kv_lora`, as the module caches it.
    LongCat-Flash-Lite (`longcat_flash_ngram`, quantmla.models.longcat_ngram) has the same blocks."""

    model_types = ("longcat_flash", "longcat_flash_ngram")
    modeling_module = "longcat_flash.modeling_longcat_flash"
    attention_class_name = "LongcatFlashMLA"

    def weight_and_cache_pairs(self, module):
        return ("interleaved", "half")

    def scale_lora(self, module, q_nope, q_rot, c):
        return (
            q_nope * module.mla_scale_q_lora,
            q_rot * module.mla_scale_q_lora,
            c * module.mla_scale_kv_lora,
        )

    def rope(self, module, q_rot, k_rot, position_embeddings):
        cos, sin = position_embeddings
        return self.modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)


ADAPTERS: dict[str, MLAAdapter] = {}
for _cls in (DeepseekV2Adapter, DeepseekV3Adapter, Glm4MoeLiteAdapter, LongcatFlashAdapter):
    for _t in _cls.model_types:
        ADAPTERS[_t] = _cls()


def get_adapter(config) -> MLAAdapter:
    """The adapter for `config.model_type`; a one-line error naming the supported types otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ConfigError("model_type", model_type, sorted(ADAPTERS))
    return ADAPTERS[model_type]
