"""The absorbed-MLA cache simulator: `patch_model` makes every MLA attention module read its latent
cache through the quantizer under a sink/recent protection policy (SPEC §5).

The transformers cache keeps storing the unquantized latent `c` and RoPE key `k_R` (the BF16
protection copies); each forward dequantizes the history per token (deterministic, so prefill and
token-by-token decoding see the same values) and attends with `quantmla.attention`.

Non-finite values: a NaN/Inf entering the cache would reach every later query that attends to its
token. With `check_finite=True` (default) the forward stops with `NonFiniteCacheError` naming the
layer and token slots instead; the quantizer itself keeps NaN/Inf inside its own group.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, replace

import torch
from torch import nn

from quantmla.attention import absorbed_attention, choose_form, expanded_attention, protected_mask
from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.models.adapters import MLAAdapter, get_adapter
from quantmla.quant import quantize_dequantize

UNQUANTIZED_BITS = 16
FORMS = ("auto", "expanded", "absorbed")
META_DTYPES = ("bfloat16", "float16", "float32")
_PRECISION_RE = re.compile(r"c(\d+)r(\d+)")


@dataclass(frozen=True)
class CachePrecision:
    content_bits: int  # 16 = unquantized
    rope_bits: int

    @property
    def quantized(self) -> bool:
        return self.content_bits < UNQUANTIZED_BITS or self.rope_bits < UNQUANTIZED_BITS


def parse_precision(precision: str) -> CachePrecision:
    """'bf16' or 'c<x>r<y>' with x, y in 1..8 or 16 (16 = that path unquantized)."""
    allowed = "'bf16' or 'c<x>r<y>' with x, y in 1..8 or 16 (e.g. c4r4, c2r4, c4r16)"
    if precision == "bf16":
        return CachePrecision(UNQUANTIZED_BITS, UNQUANTIZED_BITS)
    match = _PRECISION_RE.fullmatch(str(precision))
    if not match:
        raise ConfigError("precision", precision, allowed)
    bits = tuple(int(g) for g in match.groups())
    if any(not (1 <= b <= 8 or b == UNQUANTIZED_BITS) for b in bits):
        raise ConfigError("precision", precision, allowed)
    return CachePrecision(*bits)


@dataclass(frozen=True)
class CachePolicy:
    """How the simulated cache is read. Validated on construction."""

    precision: str = "bf16"
    sink: int = 4
    recent: int = 128
    group_size: int = 64
    form: str = "auto"  # auto | expanded | absorbed
    content_meta_dtype: str = "bfloat16"  # stored scale/zero dtype of the content latent
    rope_meta_dtype: str = "float32"  # ... of the RoPE key
    check_finite: bool = True

    def __post_init__(self):
        parse_precision(self.precision)
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, value, "an integer >= 0")
        if (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 1
        ):
            raise ConfigError(
                "group_size", self.group_size, "a positive integer dividing d_c and d_r"
            )
        if self.form not in FORMS:
            raise ConfigError("form", self.form, FORMS)
        for name in ("content_meta_dtype", "rope_meta_dtype"):
            if getattr(self, name) not in META_DTYPES:
                raise ConfigError(name, getattr(self, name), META_DTYPES)

    @property
    def bits(self) -> CachePrecision:
        return parse_precision(self.precision)

    def check_dims(self, d_c: int, d_r: int) -> None:
        """The group size must divide both cached widths (only when something is quantized)."""
        if not self.bits.quantized:
            return
        for name, dim in (("d_c", d_c), ("d_r", d_r)):
            if dim % self.group_size:
                raise ConfigError(
                    "group_size",
                    self.group_size,
                    f"a divisor of {name}={dim} (and of the other path)",
                )


def _qdq(x: torch.Tensor, bits: int, policy: CachePolicy, meta: str) -> torch.Tensor:
    if bits >= UNQUANTIZED_BITS:
        return x
    return quantize_dequantize(x, bits, policy.group_size, meta_dtype=getattr(torch, meta))


def _allowed_mask(attention_mask, q_slots: torch.Tensor, kv_len: int, batch: int) -> torch.Tensor:
    """(B, 1, n, T) bool from transformers' 4-D mask (bool or additive float), or causal by slot."""
    if attention_mask is None:
        causal = torch.arange(kv_len, device=q_slots.device)[None, :] <= q_slots[:, None]
        return causal[None, None].expand(batch, 1, -1, -1)
    mask = attention_mask[..., :kv_len]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask


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
    adapter: MLAAdapter,
    position_embeddings=None,
    attention_mask=None,
    cache=None,
    past_key_values=None,
    **kwargs,
):
    """Drop-in forward of a patched MLA attention module: same inputs and outputs as the original."""
    policy: CachePolicy = module.quantmla_policy
    cache = cache if cache is not None else past_key_values
    proj = adapter.project(module, hidden_states, position_embeddings)
    online = getattr(module, "quantmla_rope_online", None)
    if online is not None:  # QuaRot†'s post-RoPE Hadamard: cannot be fused, so it runs here
        proj.q_rot, proj.k_rot = (
            proj.q_rot @ online.to(proj.q_rot.dtype),
            proj.k_rot @ online.to(proj.k_rot.dtype),
        )
    if policy.check_finite:
        _check_finite(module.layer_idx, c=proj.c, k_R=proj.k_rot)

    b, n = hidden_states.shape[:2]
    past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
    c, k_rot = proj.c, proj.k_rot
    if cache is not None:
        c4, k4 = cache.update(c.unsqueeze(1), k_rot.unsqueeze(1), module.layer_idx, kwargs=kwargs)
        c, k_rot = c4[:, 0], k4[:, 0]
    q_slots = past + torch.arange(n, device=c.device)
    allowed = _allowed_mask(attention_mask, q_slots, c.shape[1], b)
    regions = _regions(policy, c, k_rot, allowed, q_slots)
    return attention_output(module, adapter, proj.q_nope, proj.q_rot, regions, policy.form), None


def attention_output(
    module: nn.Module, adapter: MLAAdapter, q_nope, q_rot, regions, form: str = "auto"
):
    """Post-`o_proj` attention output (B, n, hidden) of query parts over latent-cache regions."""
    geometry = (
        module.quantmla_geometry
        if hasattr(module, "quantmla_geometry")
        else adapter.geometry(module)
    )
    b, _, n, _ = q_nope.shape
    if form == "auto":
        n_keys = sum(r[0].shape[1] for r in regions)
        form = choose_form(n, n_keys, geometry.d_c, geometry.d_r, geometry.d_nope, geometry.d_v)
    if form == "absorbed":
        w_uk, w_uv = adapter.up_projections(module)
        out = absorbed_attention(q_nope, q_rot, regions, w_uk, w_uv, geometry.scaling)
    else:
        out = expanded_attention(
            q_nope, q_rot, regions, module.kv_b_proj.weight, geometry.d_nope, geometry.scaling
        )
    return module.o_proj(out.transpose(1, 2).reshape(b, n, -1).to(module.o_proj.weight.dtype))


def causal_regions(c: torch.Tensor, k_rot: torch.Tensor) -> list:
    """One region over a whole sequence (no cache, no protection): calibration and analysis."""
    n = c.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool, device=c.device).tril()[None, None]
    return [(c, k_rot, allowed.expand(c.shape[0], 1, n, n))]


def _regions(policy: CachePolicy, c, k_rot, allowed, q_slots):
    """[(c, k_R, allowed)] per region: the dequantized history and the gathered protected rows."""
    bits = policy.bits
    if not bits.quantized:
        return [(c, k_rot, allowed)]
    c_hat = _qdq(c, bits.content_bits, policy, policy.content_meta_dtype)
    k_hat = _qdq(k_rot, bits.rope_bits, policy, policy.rope_meta_dtype)
    protected = protected_mask(q_slots, c.shape[1], policy.sink, policy.recent)[None, None]
    regions = []
    quant_allowed = allowed & ~protected
    if quant_allowed.any():
        regions.append((c_hat, k_hat, quant_allowed))
    raw_allowed = allowed & protected
    columns = raw_allowed.flatten(0, 2).any(dim=0).nonzero().squeeze(-1)
    if columns.numel():
        if columns.numel() < c.shape[1]:  # gather only the protected rows (decode: sink + recent)
            c, k_rot, raw_allowed = c[:, columns], k_rot[:, columns], raw_allowed[..., columns]
        regions.append((c, k_rot, raw_allowed))
    return regions or [(c_hat, k_hat, allowed)]


def patch_model(
    model: nn.Module,
    precision: str = "c4r4",
    sink: int = 4,
    recent: int = 128,
    group_size: int = 64,
    **policy_fields,
) -> nn.Module:
    """Patch every MLA attention module of `model` in place (idempotent: re-patching updates the policy)."""
    policy = CachePolicy(
        precision=precision, sink=sink, recent=recent, group_size=group_size, **policy_fields
    )
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    if not modules:
        raise ConfigError(
            "model", type(model).__name__, f"a model with {adapter.attention_class_name} modules"
        )
    geometries = [adapter.geometry(m) for m in modules]
    for g in geometries:
        policy.check_dims(g.d_c, g.d_r)
    for module, geometry in zip(modules, geometries):
        module.quantmla_policy = policy
        module.quantmla_geometry = geometry
        if not hasattr(module, "quantmla_original_forward"):
            module.quantmla_original_forward = module.forward
            module.forward = types.MethodType(_bound_forward(adapter), module)
    return model


def _bound_forward(adapter: MLAAdapter):
    def forward(self, hidden_states, **kwargs):
        return mla_forward(self, hidden_states, adapter=adapter, **kwargs)

    return forward


def set_policy(model: nn.Module, **changes) -> None:
    """Change fields of the policy of every patched module (e.g. precision='bf16')."""
    for module in patched_modules(model):
        module.quantmla_policy = replace(module.quantmla_policy, **changes)
        module.quantmla_policy.check_dims(
            module.quantmla_geometry.d_c, module.quantmla_geometry.d_r
        )


def patched_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "quantmla_policy")]


def unpatch_model(model: nn.Module) -> nn.Module:
    """Restore the original forwards."""
    for module in patched_modules(model):
        module.forward = module.quantmla_original_forward
        del module.quantmla_original_forward, module.quantmla_policy, module.quantmla_geometry
    return model
