"""Converting a GQA checkpoint (Llama / Mistral layout) into DeepSeek-V2's MLA layout, TransMLA-style.

Per layer, from the source weights and the second moment Σ_x of the attention's input (float64):
1. **RoPE concentration.** For each RoPE frequency j, the G key heads' 2-d pairs are mixed by the
   top eigenvector u_j of their G×G energy matrix (a rotation across heads commutes with RoPE);
   that component becomes pair j of the shared `k_R` (standard frequencies, one slot each), and
   each query head h reads it with weight u_j[g(h)]. What is left of each head's key (its
   residual) loses RoPE: it joins the values as NoPE content.
2. **Joint PCA.** [residual keys; values] of the G groups are compressed to `kv_lora_rank`
   channels by the top eigenvectors of their second moment in an output-aware metric (keys
   weighted by their queries' second moment, values by `o_proj`'s Gram, the two balanced to equal
   energy), whitened back in `kv_b_proj`.
3. **The latent norm.** `kv_a_layernorm` (RMSNorm, eps = `rms_norm_eps`) runs in its linear
   regime: the latent leaves `kv_a_proj_with_mqa` at RMS ≈ τ·√eps (τ = `LINEAR_NORM_TAU`), so
   RMSNorm(a) = γ·a/√(ms(a)+eps) ≈ γ·a/√eps with relative error ≤ ms(a)/(2·eps); γ = 1/τ brings
   the cached latent back to RMS ≈ 1.
4. **Layout.** V2 rotates adjacent pairs (2i, 2i+1); Llama's rotate_half pairs (i, i+D/2). The
   softmax scale (qk_nope + qk_rope)^-1/2 is compensated in `q_proj`.

With one key head (nothing to concentrate) and `kv_lora_rank` ≥ the rank of [keys; values] the
result computes the source's function exactly (up to the norm's bound); see tests/test_conversion.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantmla.errors import ConfigError

LINEAR_NORM_TAU = 1e-3  # latent RMS before the norm, in units of √eps
SUPPORTED_SOURCES = ("llama", "mistral")
METRICS = ("output", "plain")


@dataclass(frozen=True)
class LayerConversion:
    """What the data decides for one layer: the per-frequency head mixing (rows = components,
    descending energy), the latent basis and its whitening, the latent's mean RMS."""

    mixing: torch.Tensor  # (P, G, G) float64: row 0 of each is u_j
    basis: torch.Tensor  # (2·G·D, r) float64: top eigenvectors in whitened coordinates
    whiten: torch.Tensor  # (2·G·D, 2·G·D) float64: S (block diagonal)
    unwhiten: torch.Tensor  # S^-1
    latent_rms: float
    rope_energy_kept: float  # share of the keys' energy on k_R (before the residuals lose RoPE)
    latent_energy_kept: float  # share of [residual keys; values] energy the latent keeps (whitened)


def check_source(config) -> None:
    """A source the conversion can honour, else one line naming the field."""
    if config.model_type not in SUPPORTED_SOURCES:
        raise ConfigError("source model_type", config.model_type, SUPPORTED_SOURCES)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    checks = (
        ("attention_bias", getattr(config, "attention_bias", False), False),
        ("mlp_bias", getattr(config, "mlp_bias", False), False),
        ("rope_parameters.rope_type", rope.get("rope_type", "default"), "default"),
        ("hidden_act", config.hidden_act, "silu"),
        ("head_dim % 2", head_dim % 2, 0),
        ("num_attention_heads % num_key_value_heads",
         config.num_attention_heads % config.num_key_value_heads, 0),
    )  # fmt: skip
    for name, value, allowed in checks:
        if value != allowed:
            raise ConfigError(f"source {name}", value, [allowed])


def attention_dims(config) -> tuple[int, int, int]:
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, groups, head_dim


def _pair_rows(head_dim: int) -> torch.Tensor:
    """Row indices of the P rotate_half pairs of one head: (P, 2) = (j, j + P)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1)


def interleave_pairs(rows: torch.Tensor) -> torch.Tensor:
    """(P, 2, ...) pair rows → (2P, ...) in V2's order (2j, 2j+1)."""
    return rows.reshape(rows.shape[0] * 2, *rows.shape[2:])


def _sorted_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues descending and eigenvectors (columns) with a fixed sign: each column's entry of
    largest magnitude positive, so the result is the same on any machine."""
    values, vectors = torch.linalg.eigh(matrix)
    values, vectors = values.flip(-1), vectors.flip(-1)
    pivot = vectors.abs().argmax(dim=-2, keepdim=True)
    signs = torch.sign(torch.gather(vectors, -2, pivot))
    return values, vectors * torch.where(signs == 0, 1.0, signs)


def _psd_sqrt(matrix: torch.Tensor, ridge: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root of a PSD matrix and its inverse, with a relative ridge."""
    size = matrix.shape[-1]
    matrix = matrix + ridge * matrix.diagonal().mean().clamp_min(1e-30) * torch.eye(
        size, dtype=matrix.dtype
    )
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp_min(values.max() * 1e-12)
    return (vectors * values.sqrt()) @ vectors.T, (vectors * values.rsqrt()) @ vectors.T


@dataclass(frozen=True)
class SourceLayer:
    """One source attention layer's weights, float64: q (H·D, hid), k/v (G·D, hid), o (hid, H·D)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor

    @classmethod
    def of(cls, attention) -> SourceLayer:
        return cls(*(getattr(attention, f"{n}_proj").weight.detach().double() for n in "qkvo"))


def rope_mixing(
    layer: SourceLayer, sigma: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, float]:
    """(P, G, G): per frequency, the key heads' components by descending energy under Σ_x (rows),
    and the share of the keys' energy the top components hold."""
    pairs = _pair_rows(head_dim)  # (P, 2)
    k = layer.k.view(groups, head_dim, -1)[:, pairs]  # (G, P, 2, hid)
    energy = torch.einsum("gpah,hk,fpak->pgf", k, sigma, k)  # (P, G, G)
    values, vectors = _sorted_eigh(energy)
    kept = float(values[:, 0].sum() / values.sum().clamp_min(1e-30))
    return vectors.transpose(-1, -2), kept


def _keys_split(layer: SourceLayer, mixing: torch.Tensor, groups: int, head_dim: int):
    """The shared RoPE key rows (P, 2, hid) and each group's residual key rows (G, D, hid),
    residuals in the source's own row order."""
    pairs = _pair_rows(head_dim)
    k = layer.k.view(groups, head_dim, -1)
    top = mixing[:, 0, :]  # (P, G)
    k_rope = torch.einsum("pg,gpah->pah", top, k[:, pairs])
    residual = k.clone()
    residual[:, pairs] -= torch.einsum("pg,pah->gpah", top, k_rope)
    return k_rope, residual


def _content_rows(layer: SourceLayer, mixing: torch.Tensor, groups: int, head_dim: int):
    """(k_R rows (P, 2, hid), residual keys (G, D, hid), values (G, D, hid), and the NoPE content
    [residual keys; values] stacked (2·G·D, hid)) of one layer."""
    k_rope, residual = _keys_split(layer, mixing, groups, head_dim)
    values = layer.v.view(groups, head_dim, -1)
    stacked = torch.cat([residual.flatten(0, 1), values.flatten(0, 1)])
    return k_rope, residual, values, stacked


def latent_basis(
    layer: SourceLayer,
    sigma: torch.Tensor,
    mixing: torch.Tensor,
    rope_kept: float,
    heads: int,
    groups: int,
    head_dim: int,
    rank: int,
    metric: str = "output",
) -> LayerConversion:
    """The joint PCA of [residual keys; values] in the chosen metric ("output": keys weighted by
    their queries' second moment, values by `o_proj`'s Gram; "plain": identity), key and value
    blocks balanced to equal energy."""
    if metric not in METRICS:
        raise ConfigError("metric", metric, METRICS)
    _, residual, values, stacked = _content_rows(layer, mixing, groups, head_dim)
    per_group = heads // groups
    blocks = []  # (key, value) whitening per group
    for g in range(groups):
        heads_of_g = range(g * per_group, (g + 1) * per_group)
        if metric == "plain":
            eye = torch.eye(head_dim, dtype=torch.float64)
            blocks.append((eye, eye))
            continue
        q = layer.q.view(heads, head_dim, -1)
        key_metric = sum(q[h] @ sigma @ q[h].T for h in heads_of_g)
        o = layer.o.view(layer.o.shape[0], heads, head_dim)
        value_metric = sum(o[:, h].T @ o[:, h] for h in heads_of_g)
        blocks.append((_psd_sqrt(key_metric)[0], _psd_sqrt(value_metric)[0]))
    key_energy = sum(
        torch.trace(a @ residual[g] @ sigma @ residual[g].T @ a.T)
        for g, (a, _) in enumerate(blocks)
    )
    value_energy = sum(
        torch.trace(b @ values[g] @ sigma @ values[g].T @ b.T) for g, (_, b) in enumerate(blocks)
    )
    balance = math.sqrt(float(value_energy) / max(float(key_energy), 1e-30))
    whiten = torch.block_diag(*[balance * a for a, _ in blocks], *[b for _, b in blocks])
    unwhiten = torch.linalg.inv(whiten)
    covariance = whiten @ stacked @ sigma @ stacked.T @ whiten.T
    eigenvalues, vectors = _sorted_eigh(covariance)
    basis = vectors[:, :rank]
    kept = eigenvalues[:rank].clamp_min(0).sum()
    latent_kept = float(kept / eigenvalues.clamp_min(0).sum().clamp_min(1e-30))
    latent_rms = math.sqrt(max(float(kept) / rank, 1e-30))
    return LayerConversion(mixing, basis, whiten, unwhiten, latent_rms, rope_kept, latent_kept)


def query_weights(
    q: torch.Tensor, top: torch.Tensor, heads: int, groups: int, head_dim: int
) -> torch.Tensor:
    """V2's `q_proj` (H·2D, hid) from the source's (H·D, hid) and each frequency's top mixing
    row `top` (P, G): per head [NoPE = the source query in its own order (the residual keys'),
    RoPE = u_j[g(h)]·pair j in V2's order], times √2 for V2's softmax scale (D_nope + D_rope)^-1/2."""
    pairs = _pair_rows(head_dim)
    q = q.view(heads, head_dim, -1)
    weight = top[:, torch.arange(heads) // (heads // groups)].T  # (H, P)
    q_rope = (weight[:, :, None, None] * q[:, pairs]).reshape(heads, head_dim, -1)
    return math.sqrt(2.0) * torch.cat([q, q_rope], dim=1).reshape(-1, q.shape[-1])


def convert_layer(
    layer: SourceLayer,
    plan: LayerConversion,
    heads: int,
    groups: int,
    head_dim: int,
    eps: float,
) -> dict[str, torch.Tensor]:
    """The V2 attention weights (float64) of one layer from its source weights and plan."""
    per_group = heads // groups
    k_rope, _, _, stacked = _content_rows(layer, plan.mixing, groups, head_dim)

    # Latent: ĉ = Bᵀ S z / ρ (RMS ≈ 1); kv_a emits it scaled by τ√eps, the norm's γ = 1/τ undoes that.
    pre_norm_scale = LINEAR_NORM_TAU * math.sqrt(eps)
    latent_rows = (plan.basis.T @ plan.whiten @ stacked) / plan.latent_rms
    kv_a = torch.cat([pre_norm_scale * latent_rows, interleave_pairs(k_rope)])
    gamma = torch.full((plan.basis.shape[1],), 1.0 / LINEAR_NORM_TAU, dtype=torch.float64)

    # kv_b: z ≈ ρ S⁻¹ B ĉ; per head [its group's residual key (D), its group's value (D)].
    recon = plan.latent_rms * plan.unwhiten @ plan.basis  # (2·G·D, r)
    keys_recon, values_recon = recon.view(2, groups, head_dim, -1)
    group_of = torch.arange(heads) // per_group
    kv_b = torch.stack([keys_recon[group_of], values_recon[group_of]], dim=1).reshape(
        -1, recon.shape[-1]
    )

    return {
        "q_proj.weight": query_weights(layer.q, plan.mixing[:, 0, :], heads, groups, head_dim),
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": gamma,
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": layer.o,
    }


def target_config(source_config, kv_lora_rank: int):
    """The DeepSeek-V2 config of the converted model: dense MLPs, MLA heads of the source's head
    dim for NoPE, RoPE and values, the source's RoPE base, eps 1e-6 (the latent norm's; vLLM and
    transformers must agree on it, see the module docstring)."""
    from transformers import DeepseekV2Config

    from quantmla.models.tiny import dense_mla_fields

    heads, _, head_dim = attention_dims(source_config)
    s = source_config
    rope = dict(getattr(s, "rope_parameters", None) or {})
    fields = dense_mla_fields(
        s.vocab_size, hidden_size=s.hidden_size, num_layers=s.num_hidden_layers, num_heads=heads,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim,
        v_head_dim=head_dim, intermediate_size=s.intermediate_size,
        max_position_embeddings=s.max_position_embeddings,
        rope_theta=rope.get("rope_theta", 10000.0), bos_token_id=s.bos_token_id,
        eos_token_id=s.eos_token_id, pad_token_id=getattr(s, "pad_token_id", None),
    )  # fmt: skip
    fields["tie_word_embeddings"] = getattr(s, "tie_word_embeddings", False)
    return DeepseekV2Config(
        **fields, hidden_act=s.hidden_act, rms_norm_eps=1e-6, attention_bias=False
    )


def convert_model(source, sigmas: list[torch.Tensor], kv_lora_rank: int, metric: str = "output"):
    """A `DeepseekV2ForCausalLM` (float32) from a Llama-layout model and each layer's Σ_x, with its
    per-layer plans (what a rebuild needs besides the source weights)."""
    from transformers import DeepseekV2ForCausalLM

    check_source(source.config)
    heads, groups, head_dim = attention_dims(source.config)
    if kv_lora_rank < 1:
        raise ConfigError("kv_lora_rank", kv_lora_rank, "a positive integer")
    config = target_config(source.config, kv_lora_rank)
    plans = []
    with torch.device("meta"):
        target = DeepseekV2ForCausalLM(config)
    state = {}
    for name, tensor in source.state_dict().items():
        if ".self_attn." not in name:
            state[name] = tensor.detach().float().clone()
    for index, block in enumerate(source.model.layers):
        layer = SourceLayer.of(block.self_attn)
        mixing, rope_kept = rope_mixing(layer, sigmas[index], groups, head_dim)
        plan = latent_basis(
            layer, sigmas[index], mixing, rope_kept, heads, groups, head_dim, kv_lora_rank, metric
        )
        plans.append(plan)
        for key, value in convert_layer(
            layer, plan, heads, groups, head_dim, config.rms_norm_eps
        ).items():
            state[f"model.layers.{index}.self_attn.{key}"] = value.float()
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    target.load_state_dict(state, assign=True, strict=False)
    target.tie_weights()
    missing = [n for n, p in target.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"conversion left parameters unset: {missing[:4]}")
    target.model.rotary_emb = type(target.model.rotary_emb)(config)  # buffers off the meta device
    return target.eval(), plans


@torch.no_grad()
def attention_input_moments(model, windows: torch.Tensor, progress=None) -> list[torch.Tensor]:
    """Σ_x = mean over tokens of x_t x_tᵀ (float64) of every layer's attention input (after its
    input norm) over `windows` (N, T), one window at a time."""
    layers = model.model.layers
    sums = [
        torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=torch.float64)
        for _ in layers
    ]
    handles = []
    for index, block in enumerate(layers):

        def hook(_module, args, kwargs, index=index):
            x = (args[0] if args else kwargs["hidden_states"]).detach().double().flatten(0, -2)
            sums[index] += x.T @ x

        handles.append(block.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        for row in windows:
            model(input_ids=row[None], use_cache=False)
            if progress is not None:
                progress()
    finally:
        for handle in handles:
            handle.remove()
    return [total / windows.numel() for total in sums]
