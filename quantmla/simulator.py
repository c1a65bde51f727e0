"""The absorbed-MLA cache simulator: `patch_model` makes every MLA attention module read its latent
cache through the quantizer under a sink/recent protection policy (docs/method.md §5).

The transformers cache keeps storing the unquantized latent `c` and RoPE key `k_R` (the BF16
protection copies). Quantization is per token and deterministic, so prefill and token-by-token
decoding see the same values: a `DynamicCache` keeps each token's dequantized copy, made once when
the token enters (`quantmla.cache.simulated`); without a cache, or with another cache type, the history is
quantize-dequantized in the forward. Attention is `quantmla.attention`.

Non-finite values: a NaN/Inf entering the cache would reach every later query that attends to its
token. With `check_finite=True` (default) the forward stops with `NonFiniteCacheError` naming the
layer and token slots instead; the quantizer itself keeps NaN/Inf inside its own group.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from quantmla.attention import (
    PrefillContext,
    attention_output,
    cache_regions,
    choose_form,
    prefill_attention,
)
from quantmla.cache.packed import packed_attention
from quantmla.cache.simulated import dequantized_layer
from quantmla.errors import ConfigError, NonFiniteCacheError, QuantMLAError
from quantmla.memory import CacheLayout
from quantmla.models.adapters import MLAAdapter, MLAGeometry, get_adapter
from quantmla.policy import CachePolicy
from quantmla.quant import qdq_content, qdq_rope
from quantmla_kernels.paged_cache.layout import held_positions


@dataclass
class LayerPatch:
    """Everything a patched MLA module's forward needs, owned by the patch (one object per module).

    `rope_online`: an orthogonal matrix applied to the post-RoPE query and key before caching
    (QuaRot†'s Hadamard, which cannot be fused); None for every other method."""

    adapter: MLAAdapter
    geometry: MLAGeometry
    policy: CachePolicy
    original_forward: object  # an instance-level forward that was there before, else None
    rope_online: torch.Tensor | None = None


PATCH_ATTRIBUTE = "quantmla_patch"


def _allowed_mask(attention_mask, q_slots: torch.Tensor, kv_len: int, batch: int) -> torch.Tensor:
    """(B, 1, n, T) bool from transformers' 4-D mask (bool or additive float), or causal by slot."""
    if attention_mask is None:
        causal = torch.arange(kv_len, device=q_slots.device)[None, :] <= q_slots[:, None]
        return causal[None, None].expand(batch, 1, -1, -1)
    mask = attention_mask[..., :kv_len]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


def _reads_causally(allowed: torch.Tensor | None, q_slots: torch.Tensor) -> bool:
    """Every query that reads itself (not padding) reads exactly the keys up to its own slot (no
    mask, None — transformers' unpadded causal batches — is causal by slot: nothing to build)."""
    if allowed is None:
        return True
    kv_len = allowed.shape[-1]
    causal = torch.arange(kv_len, device=allowed.device)[None, :] <= q_slots[:, None]
    itself = allowed[..., torch.arange(q_slots.shape[0], device=allowed.device), q_slots]
    return bool(((allowed == causal) | ~itself[..., None]).all())


def _causal_prefill(module, patch: LayerPatch, q_nope, q_rot, c, k_rot, hats, past: int):
    """(B, n, H · d_v) attention of n queries at slots past .. past + n − 1 over all earlier tokens
    under the policy's rule, by `prefill_attention` (fused passes, each pair scored once) per
    sequence: the earlier tokens as its context (their dequantized copies and protection rows)."""
    policy, g = patch.policy, patch.geometry
    spec, weight = policy.spec, module.kv_b_proj.weight
    q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)  # (B, n, H, d_nope + d_r)
    n = q.shape[1]
    outs = []
    for b in range(q.shape[0]):
        context = None
        if past:  # the earlier tokens: their cache copy (dequantized or as written), exact rows
            if spec.quantized:
                copy = (hats[0][b], hats[1][b]) if hats is not None else (
                    qdq_content(spec, c[b]), qdq_rope(spec, k_rot[b]))  # fmt: skip
                held = held_positions(past, policy.sink, policy.recent).to(c.device)
            else:
                copy, held = (c[b], k_rot[b]), torch.empty(0, dtype=torch.int64, device=c.device)
            context = PrefillContext(
                past, held, torch.cat([c[b], k_rot[b]], dim=-1)[held],
                lambda i, j, copy=copy: (copy[0][i:j], copy[1][i:j]), past + n,
                written=spec.quantized,
            )  # fmt: skip
        outs.append(prefill_attention(
            q[b], c[b, past:], k_rot[b, past:], lambda x: F.linear(x, weight), spec,
            policy.sink, policy.recent, g.d_nope, g.d_v, g.scaling, context=context,
        ))  # fmt: skip
    out = torch.stack(outs).view(q.shape[0], n, -1)
    return module.o_proj(out.to(module.o_proj.weight.dtype))


def _check_finite(layer_idx: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        bad = ~torch.isfinite(t).all(dim=-1)  # (B, n)
        if bad.any():
            slots = bad.nonzero()[:, -1].unique().tolist()[:8]
            raise NonFiniteCacheError(
                f"layer {layer_idx}: cached {name} has NaN/Inf at token positions {slots} (of this forward); "
                "stopped before it reaches other tokens' attention"
            )


def mla_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    *,
    patch: LayerPatch,
    position_embeddings=None,
    attention_mask=None,
    cache=None,
    past_key_values=None,
    **kwargs,
):
    """Drop-in forward of a patched MLA attention module: same inputs and outputs as the original."""
    policy, adapter = patch.policy, patch.adapter
    cache = cache if cache is not None else past_key_values
    proj = adapter.project(module, hidden_states, position_embeddings)
    if patch.rope_online is not None:  # QuaRot†'s post-RoPE Hadamard: cannot be fused
        online = patch.rope_online.to(proj.q_rot)
        proj.q_rot, proj.k_rot = proj.q_rot @ online, proj.k_rot @ online
    if policy.check_finite:
        _check_finite(module.layer_idx, c=proj.c, k_R=proj.k_rot)

    b, n = hidden_states.shape[:2]
    past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
    if cache is not None and policy.backend == "packed" and policy.spec.quantized:
        q_slots = past + torch.arange(n, device=proj.c.device)
        allowed = _allowed_mask(attention_mask, q_slots, past + n, b)
        layout = CacheLayout(
            policy.spec, patch.geometry.d_c, patch.geometry.d_r, policy.sink, policy.recent
        )
        return packed_attention(module, patch, proj, cache, allowed, layout), None
    c, k_rot = proj.c, proj.k_rot
    hats = None
    if cache is not None:
        new_c, new_k = c.unsqueeze(1), k_rot.unsqueeze(1)
        c4, k4 = cache.update(new_c, new_k, module.layer_idx, kwargs=kwargs)
        c, k_rot = c4[:, 0], k4[:, 0]
        spec = policy.spec
        layer = dequantized_layer(cache, module.layer_idx) if policy.incremental else None
        if layer is not None and spec.quantized:
            c4_hat, k4_hat = layer.dequantized(new_c, new_k, spec)
            hats = (c4_hat[:, 0], k4_hat[:, 0])
    q_slots = past + torch.arange(n, device=c.device)
    form, g = policy.form, patch.geometry
    if form == "auto":
        keys = c.shape[1] * (2 if policy.spec.quantized else 1)
        form = choose_form(n, keys, g.d_c, g.d_r, g.d_nope, g.d_v)
    allowed = (
        None if attention_mask is None else _allowed_mask(attention_mask, q_slots, c.shape[1], b)
    )
    if form == "expanded" and c.device.type == "cpu" and _reads_causally(allowed, q_slots):
        out = _causal_prefill(module, patch, proj.q_nope, proj.q_rot, c, k_rot, hats, past)
        return out, None
    if allowed is None:
        allowed = _allowed_mask(None, q_slots, c.shape[1], b)
    regions = cache_regions(policy, c, k_rot, allowed, q_slots, hats)
    out = attention_output(
        module, adapter, proj.q_nope, proj.q_rot, regions, policy.form, patch.geometry
    )
    return out, None


def patch_model(
    model: nn.Module,
    precision: str | Sequence[str] = "c4r4",
    sink: int = 4,
    recent: int = 128,
    group_size: int = 64,
    **policy_fields,
) -> nn.Module:
    """Patch every MLA attention module of `model` in place (idempotent: re-patching updates the
    policy). `precision` is one precision for every layer, or one per MLA layer (a mixed
    allocation: each layer's cache its own format; `quantmla.allocation`)."""
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    if not modules:
        raise ConfigError(
            "model", type(model).__name__, f"a model with {adapter.attention_class_name} modules"
        )
    per_layer = [precision] * len(modules) if isinstance(precision, str) else list(precision)
    if len(per_layer) != len(modules):
        raise ConfigError(
            "precision (per layer)", len(per_layer), f"{len(modules)}: one per MLA layer"
        )
    policies = {
        p: CachePolicy(
            precision=p, sink=sink, recent=recent, group_size=group_size, **policy_fields
        )
        for p in dict.fromkeys(per_layer)
    }
    geometries = [adapter.geometry(m) for m in modules]
    for g, p in zip(geometries, per_layer):
        policies[p].check_dims(g.d_c, g.d_r)
    for module, geometry, p in zip(modules, geometries, per_layer):
        policy = policies[p]
        existing = getattr(module, PATCH_ATTRIBUTE, None)
        if existing is not None:
            existing.policy, existing.geometry = policy, geometry
            continue
        patch = LayerPatch(adapter, geometry, policy, module.__dict__.get("forward"))
        setattr(module, PATCH_ATTRIBUTE, patch)
        module.forward = types.MethodType(_patched_forward, module)
    return model


def _patched_forward(self, hidden_states, **kwargs):
    """The patched module's forward; it finds its patch on itself, so a deep copy finds its own."""
    return mla_forward(self, hidden_states, patch=layer_patch(self), **kwargs)


def layer_patch(module: nn.Module) -> LayerPatch:
    """The patch state of one MLA module (stops if the model was not patched)."""
    patch = getattr(module, PATCH_ATTRIBUTE, None)
    if patch is None:
        raise QuantMLAError(
            f"{type(module).__name__} is not patched: call patch_model(model) first"
        )
    return patch


def set_policy(model: nn.Module, precision: str | Sequence[str] | None = None, **changes) -> None:
    """Change fields of the policy of every patched module (e.g. precision='bf16'); `precision`
    may also be one per patched layer, in layer order (a mixed allocation)."""
    modules = patched_modules(model)
    per_layer = (
        [precision] * len(modules)
        if precision is None or isinstance(precision, str)
        else list(precision)
    )
    if len(per_layer) != len(modules):
        raise ConfigError(
            "precision (per layer)", len(per_layer), f"{len(modules)}: one per MLA layer"
        )
    for module, p in zip(modules, per_layer):
        patch = layer_patch(module)
        policy = replace(patch.policy, **changes, **({} if p is None else {"precision": p}))
        policy.check_dims(patch.geometry.d_c, patch.geometry.d_r)
        patch.policy = policy


def patched_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, PATCH_ATTRIBUTE, None) is not None]


def unpatch_model(model: nn.Module) -> nn.Module:
    """Restore the original forwards and drop every piece of patch state (QuaRot†'s matrix included)."""
    for module in patched_modules(model):
        original = layer_patch(module).original_forward
        if original is None:
            del module.forward  # the class's own forward again
        else:
            module.forward = original
        delattr(module, PATCH_ATTRIBUTE)
    return model
