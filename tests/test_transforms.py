import pytest
import torch
from transformers import DynamicCache

from quantmla.models.adapters import get_adapter
from quantmla.models.loading import random_model_from_config_file
from quantmla.transforms import (
    ContentTransform,
    RopeTransform,
    cayley,
    fuse_content,
    fuse_rope,
    hadamard,
)
from tests.conftest import MODEL_CONFIGS, rel_err

F64 = torch.float64


def random_transforms(d_c, d_r, seed=0):
    g = torch.Generator().manual_seed(seed)
    content = ContentTransform(
        cayley(torch.randn(d_c, d_c, generator=g, dtype=F64) * 0.2),
        torch.rand(d_c, generator=g, dtype=F64) * 3 + 0.2,
    )
    rope = RopeTransform(
        torch.randn(d_r // 2, generator=g, dtype=F64) * 2,
        torch.rand(d_r // 2, generator=g, dtype=F64) * 3 + 0.2,
    )
    return content, rope


def test_cayley_is_orthogonal_and_identity_at_zero():
    p = torch.randn(64, 64, dtype=F64)
    r = cayley(p)
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=F64), atol=1e-12)
    assert torch.det(r) > 0
    assert torch.equal(cayley(torch.zeros(8, 8, dtype=F64)), torch.eye(8, dtype=F64))


@pytest.mark.parametrize("dim", [1, 2, 64, 128, 512])
def test_hadamard_is_orthonormal(dim):
    h = hadamard(dim)
    assert torch.allclose(h @ h.T, torch.eye(dim, dtype=F64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full_like(h, dim**-0.5))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_reciprocal_query_key_preserves_scores(layout):
    _, rope = random_transforms(8, 64)
    q, k = torch.randn(5, 64, dtype=F64), torch.randn(7, 64, dtype=F64)
    scores = (q @ rope.query_matrix(layout)) @ (k @ rope.key_matrix(layout)).T
    assert torch.allclose(scores, q @ k.T, atol=1e-10)


def families():
    seen, unique = set(), []
    for path in MODEL_CONFIGS:
        model = random_model_from_config_file(path, num_layers=1, max_heads=4)
        key = (
            model.config.model_type,
            getattr(model.config, "rope_interleave", None),
            model.config.q_lora_rank is None,
        )
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


FAMILY_CONFIGS = families() if MODEL_CONFIGS else []


@pytest.mark.parametrize("path", FAMILY_CONFIGS, ids=lambda p: p.stem)
def test_rope_transform_commutes_with_positional_rotation(path):
    """RoPE(x M_w) = RoPE(x) M_c at arbitrary positions (M in pre-RoPE and cache pair layouts)."""
    model = random_model_from_config_file(path, num_layers=1, max_heads=4).double()
    adapter = get_adapter(model.config)
    module = adapter.attention_modules(model)[0]
    geo = adapter.geometry(module)
    _, rope = random_transforms(8, geo.d_r, seed=1)
    positions = torch.tensor([[0, 3, 1000, 123_457]])
    x = torch.randn(1, 1, 4, geo.d_r, dtype=F64)
    emb = model.model.rotary_emb(x, positions)
    emb = emb if isinstance(emb, torch.Tensor) else tuple(e.double() for e in emb)
    rot_of_transformed, _ = adapter.rope(module, x @ rope.key_matrix(geo.weight_pairs), x, emb)
    rotated, _ = adapter.rope(module, x, x, emb)
    assert torch.allclose(
        rot_of_transformed.double(), rotated.double() @ rope.key_matrix(geo.cache_pairs), atol=1e-5
    )
    wrong = "half" if geo.weight_pairs == "interleaved" else "interleaved"
    mixed, _ = adapter.rope(module, x @ rope.key_matrix(wrong), x, emb)
    assert not torch.allclose(
        mixed.double(), rotated.double() @ rope.key_matrix(geo.cache_pairs), atol=1e-2
    )


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_fusion_is_equivalent_and_caches_transformed_values(path):
    model = random_model_from_config_file(path, max_heads=8, experts_implementation="eager")
    adapter = get_adapter(model.config)
    x = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ref = model(x, cache=cache, use_cache=True).logits
        modules = adapter.attention_modules(model)
        transforms = [
            random_transforms(m.kv_lora_rank, m.qk_rope_head_dim, seed=i)
            for i, m in enumerate(modules)
        ]
        gammas = [m.kv_a_layernorm.weight.detach().double().clone() for m in modules]
        for module, (content, rope) in zip(modules, transforms):
            fuse_content(module, adapter, content)
            fuse_rope(module, adapter, rope)
        fused_cache = DynamicCache(config=model.config)
        out = model(x, cache=fused_cache, use_cache=True).logits
    assert rel_err(out, ref) <= 1e-5
    for i, (module, (content, rope)) in enumerate(zip(modules, transforms)):
        c, k = (
            cache.layers[module.layer_idx].keys.double(),
            cache.layers[module.layer_idx].values.double(),
        )
        z, k_fused = (
            fused_cache.layers[module.layer_idx].keys.double(),
            fused_cache.layers[module.layer_idx].values.double(),
        )
        # z = u R_C S_C with u = c / Γ (LongCat's scalar mla_scale_kv_lora multiplies both sides)
        assert rel_err(z, ((c / gammas[i]) @ content.rotation) * content.scale) <= 1e-4
        pairs = adapter.geometry(module).cache_pairs
        assert rel_err(k_fused, k @ rope.key_matrix(pairs)) <= 1e-4
