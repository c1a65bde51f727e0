"""The project's own small MLA testbed: its byte-level BPE tokenizer and its DeepSeek-V3-architecture config.

Design choices (see docs/testbeds.md):
- `q_lora_rank=None`: queries come from one `q_proj`, as in DeepSeek-V2-Lite and Moonlight, the
  paper's two main models, so the tiny model exercises the same query path as they do.
- `rope_interleave=True`: the V3/Moonlight checkpoint layout (pre-RoPE pairs interleaved, cached
  k_R half-split), the layout where a wrong pairing breaks RoPE-transform fusion.
- `qk_rope_head_dim=64` (one quantization group, as in every real model), `kv_lora_rank=128`
  (two content groups), dense MLP (MoE adds nothing to cache quantization).
"""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        model_max_length=1 << 20,
    )


def dense_mla_fields(
    vocab_size: int,
    hidden_size: int = 256,
    num_layers: int = 6,
    num_heads: int = 4,
    kv_lora_rank: int = 128,
    qk_nope_head_dim: int = 64,
    qk_rope_head_dim: int = 64,
    v_head_dim: int = 64,
    intermediate_size: int = 768,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    bos_token_id: int = 0,
    eos_token_id: int = 1,
    pad_token_id: int = 2,
) -> dict:
    """The fields both testbeds share: every layer dense (no MoE), no query LoRA, tied embeddings."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        first_k_dense_replace=num_layers,  # all layers dense
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_shared_experts=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def tiny_mla_config(vocab_size: int, **dims):
    """A dense DeepSeek-V3-architecture config for the tiny testbed (`dense_mla_fields` defaults)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **dense_mla_fields(vocab_size, **dims),
        n_group=1,
        topk_group=1,
        rope_interleave=True,
        num_nextn_predict_layers=0,
    )


def tiny_mla_v2_config(vocab_size: int, **dims):
    """The second testbed: a dense DeepSeek-V2-architecture config (V2's RoPE layout: interleaved
    pairs in the weights and in the cache), four content groups (d_c 256), positions to 4K."""
    from transformers import DeepseekV2Config

    dims = {"kv_lora_rank": 256, "max_position_embeddings": 4096, **dims}
    return DeepseekV2Config(**dense_mla_fields(vocab_size, **dims))


def widen_latent_state(state: dict, old_rank: int, new_rank: int) -> dict:
    """Map a tiny-mla (V3 layout) state dict onto a V2 model with a wider latent, exactly.

    The latent c (old_rank) is duplicated to new_rank = k·old_rank channels: the down-projection
    rows and the RMSNorm weight repeat (the RMS of [c; c] is the RMS of c) and the up-projection
    columns repeat divided by k, so every layer computes the same function. The RoPE rows and the
    q_proj layout carry over unchanged: V3 with rope_interleave and V2 rotate the same (2i, 2i+1)
    pairs by the same angles, and only the order of the rotated coordinates differs, which no
    q·k dot product sees."""
    import torch

    if new_rank % old_rank:
        raise ValueError(f"kv_lora_rank {new_rank} is not a multiple of {old_rank}")
    k = new_rank // old_rank
    out = {}
    for name, w in state.items():
        if name.endswith("kv_a_proj_with_mqa.weight"):
            w = torch.cat([w[:old_rank]] * k + [w[old_rank:]], 0)
        elif name.endswith("kv_a_layernorm.weight"):
            w = torch.cat([w] * k, 0)
        elif name.endswith("kv_b_proj.weight"):
            w = torch.cat([w / k] * k, 1)
        out[name] = w
    return out
