"""LongCat-Flash-Lite (`longcat_flash_ngram`): transformers' LongCat-Flash decoder behind our own
n-gram embedding front end. No remote code and no copied modeling file: the config and model
subclass transformers' `LongcatFlash*` classes and add only what Lite has on top.

The front end (public descriptions: the model's remote code, vLLM, SGLang): for orders 2..n and
k hash splits per order, k·(n−1) tables; table `idx = (order−2)·k + j` has `m_idx = M + 2·idx + 1`
rows (M = ngram_vocab_size_ratio · V) and is `hidden / (k·(n−1))` wide. A token's id in table idx
reads its n-gram as a base-V number, the token itself the lowest digit, each power of V taken mod
m_idx; predecessors that do not exist count as 0, and a token looks back only within its own
EOS-terminated segment (an EOS keeps its own look-back; the token after it starts afresh). The
embedding is the mean of the token embedding and the k·(n−1) bias-free projections of the looked-up
rows. The only decoding state is each sequence's last n−1 tokens: kept beside the KV cache, on the
cache object (`NGRAM_STATE`), so incremental decoding equals a full recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import LongcatFlashConfig
from transformers.models.longcat_flash import modeling_longcat_flash as flash
from transformers.utils.deprecation import deprecate_kwarg

from quantmla.errors import CheckpointError, ConfigError

MODEL_TYPE = "longcat_flash_ngram"
NGRAM_STATE = "quantmla_ngram_state"  # attribute of a transformers Cache that holds the history
MISSING = -1  # history slot with no token (sequence start, left padding)


@strict
class LongcatFlashNgramConfig(LongcatFlashConfig):
    """LongCat-Flash's config plus the n-gram fields; refuses, in one line, what the LongCat-Flash
    classes cannot honour."""

    model_type = MODEL_TYPE
    ngram_vocab_size_ratio: int | float | None = None
    emb_neighbor_num: int | None = None
    emb_split_num: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_fields(self)

    @property
    def ngram_tables(self) -> int:
        return self.emb_split_num * (self.emb_neighbor_num - 1)

    @property
    def ngram_table_rows(self) -> list[int]:
        base = int(self.ngram_vocab_size_ratio * self.vocab_size)
        return [base + 2 * idx + 1 for idx in range(self.ngram_tables)]


def check_fields(config) -> None:
    """One line for any field combination the LongCat-Flash classes and our front end cannot honour."""
    for name in ("ngram_vocab_size_ratio", "emb_neighbor_num", "emb_split_num"):
        if getattr(config, name, None) is None:
            raise ConfigError(
                name, None, f"a number ({MODEL_TYPE} is defined by its n-gram front end)"
            )
    if config.emb_neighbor_num < 2:
        raise ConfigError("emb_neighbor_num", config.emb_neighbor_num, "an order >= 2")
    if config.emb_split_num < 1:
        raise ConfigError("emb_split_num", config.emb_split_num, "at least one table per order")
    if config.hidden_size % config.ngram_tables:
        raise ConfigError(
            "hidden_size",
            config.hidden_size,
            f"a multiple of emb_split_num·(emb_neighbor_num−1) = {config.ngram_tables}",
        )
    rows = config.ngram_vocab_size_ratio * config.vocab_size
    if rows != int(rows) or rows < 1:
        raise ConfigError(
            "ngram_vocab_size_ratio",
            config.ngram_vocab_size_ratio,
            "ratio·vocab_size a whole number",
        )
    if (config.vocab_size - 1) * max(config.ngram_table_rows) * config.emb_neighbor_num >= 2**63:
        raise ConfigError(
            "ngram_vocab_size_ratio", config.ngram_vocab_size_ratio, "ids within int64"
        )
    for name in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if getattr(config, name, True) is not True:
            raise ConfigError(
                name, getattr(config, name), "true (LongCat-Flash's MLA always scales)"
            )
    if getattr(config, "norm_topk_prob", False):
        raise ConfigError("norm_topk_prob", True, "false (LongCat-Flash's router never normalises)")
    if getattr(config, "zero_expert_type", "identity") != "identity":
        raise ConfigError("zero_expert_type", config.zero_expert_type, "identity")


def _eos_ids(config) -> list[int]:
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def ngram_ids(
    tokens: torch.Tensor,
    powers: torch.Tensor,
    rows: torch.Tensor,
    eos_ids: list[int],
    history: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T, tables), the new history (B, n−1)) of `tokens` (B, T).

    `powers` (tables, n): V^δ mod m_idx for δ below the table's order, 0 above it; `rows` (tables,):
    m_idx. `history` (B, n−1): the tokens before `tokens` (MISSING where none); `valid` (B, T):
    False at padding, which then counts as missing for the tokens after it."""
    b, t = tokens.shape
    n = powers.shape[1]
    if history is None:
        history = tokens.new_full((b, n - 1), MISSING)
    seen = tokens if valid is None else torch.where(valid, tokens, MISSING)
    full = torch.cat([history.to(tokens), seen], 1)
    digits, alive = [tokens.clamp(min=0)], torch.ones_like(tokens, dtype=torch.bool)
    for delta in range(1, n):
        before = full[:, n - 1 - delta : n - 1 - delta + t]
        alive = alive & (before >= 0) & ~torch.isin(before, tokens.new_tensor(eos_ids))
        digits.append(torch.where(alive, before, 0))
    ids = (torch.stack(digits, -1).unsqueeze(-2) * powers).sum(-1) % rows
    return ids, full[:, t:]


def hash_powers(config) -> list[list[int]]:
    """Per table: V^δ mod m_idx for the δ below its order (2 + idx // k), 0 above."""
    n, k, v = config.emb_neighbor_num, config.emb_split_num, config.vocab_size
    return [
        [pow(v, delta, rows) if delta < 2 + idx // k else 0 for delta in range(n)]
        for idx, rows in enumerate(config.ngram_table_rows)
    ]


class NgramEmbedding(nn.Module):
    """The n-gram tables and their projections; `forward` averages them with the token embedding."""

    def __init__(self, config: LongcatFlashNgramConfig):
        super().__init__()
        width = config.hidden_size // config.ngram_tables
        rows = config.ngram_table_rows
        self.embedders = nn.ModuleList(nn.Embedding(r, width) for r in rows)
        self.post_projs = nn.ModuleList(
            nn.Linear(width, config.hidden_size, bias=False) for _ in rows
        )
        # plain lists, not buffers: a model loaded from the meta device never initialises those
        self.powers, self.eos_ids = hash_powers(config), _eos_ids(config)
        self.rows = rows

    def ids(self, tokens, history=None, valid=None):
        def as_tensor(values):
            return torch.tensor(values, dtype=torch.long, device=tokens.device)

        return ngram_ids(
            tokens, as_tensor(self.powers), as_tensor(self.rows), self.eos_ids, history, valid
        )

    def forward(self, word_embeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        total = word_embeds
        for i, (table, proj) in enumerate(zip(self.embedders, self.post_projs)):
            total = total + proj(table(ids[..., i]))  # table i reads id column i
        return total / (1 + len(self.embedders))


@dataclass
class NgramState:
    """A sequence batch's last n−1 tokens and the cache length they were recorded at."""

    history: torch.Tensor
    length: int


def _history(cache, batch: int) -> torch.Tensor | None:
    """The n-gram history kept on `cache`; None for an empty cache. One line when the cache holds
    tokens the history does not describe (a cache filled elsewhere, cropped or reordered)."""
    if cache is None:
        return None
    seen = cache.get_seq_length()
    state = getattr(cache, NGRAM_STATE, None)
    if seen == 0:
        return None
    if state is None or state.length != seen or state.history.shape[0] != batch:
        recorded = "none" if state is None else f"{state.length} tokens × {state.history.shape[0]}"
        raise ConfigError(
            "cache",
            f"{seen} tokens × {batch} sequences (n-gram history: {recorded})",
            f"a cache this {MODEL_TYPE} model filled itself, not cropped or reordered "
            "(its n-gram embedding needs each sequence's last tokens)",
        )
    return state.history


class LongcatFlashNgramModel(flash.LongcatFlashModel):
    """LongCat-Flash's decoder behind the n-gram front end; routed experts hold weights only for the
    `n_routed_experts` that have them (the zero-computation experts are identities)."""

    config_class = LongcatFlashNgramConfig

    def __init__(self, config: LongcatFlashNgramConfig):
        super().__init__(config)
        self.ngram_embeddings = NgramEmbedding(config)
        for layer in self.layers:
            drop_zero_expert_weights(layer.mlp.experts)
        self.post_init()

    def embed(self, input_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """The front end's embeddings of `input_ids`; records the history on `cache`."""
        valid = None
        if attention_mask is not None and attention_mask.dim() == 2:
            valid = attention_mask[:, -input_ids.shape[1] :].bool()
        history = _history(cache, input_ids.shape[0])
        ids, new_history = self.ngram_embeddings.ids(input_ids, history, valid)
        if cache is not None:
            length = cache.get_seq_length() + input_ids.shape[1]
            setattr(cache, NGRAM_STATE, NgramState(new_history, length))
        return self.ngram_embeddings(self.embed_tokens(input_ids), ids)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ):
        if inputs_embeds is not None:
            raise ConfigError(
                "inputs_embeds", "given", f"input_ids ({MODEL_TYPE}'s embedding reads token ids)"
            )
        if input_ids is None:
            raise ConfigError("input_ids", None, "token ids")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
        embeds = self.embed(input_ids, attention_mask, cache if use_cache else None)
        return super().forward(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=embeds,
            use_cache=use_cache,
            **kwargs,
        )


def drop_zero_expert_weights(experts: nn.Module) -> None:
    """transformers 5.24 allocates `gate_up_proj` for routed + zero experts; only routed ones have
    weights (the forward never reads the others), so the published checkpoint's experts fit.
    (5.25 allocates the routed ones only and names their count `num_experts`: nothing to drop.)"""
    gate_up = experts.gate_up_proj
    routed = getattr(experts, "num_routed_experts", None) or getattr(experts, "num_experts", None)
    if gate_up is not None and routed is not None and gate_up.shape[0] > routed:
        kept = gate_up.detach()[:routed].clone()  # keeps their initialisation
        experts.gate_up_proj = nn.Parameter(kept)


class LongcatFlashNgramForCausalLM(flash.LongcatFlashForCausalLM):
    config_class = LongcatFlashNgramConfig

    def __init__(self, config: LongcatFlashNgramConfig):
        flash.LongcatFlashPreTrainedModel.__init__(self, config)  # not LongcatFlashForCausalLM's:
        self.model = LongcatFlashNgramModel(config)  # it would build a second decoder
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def generate(self, *args, **kwargs):
        """transformers' generate; beam search refused (it reorders the cache, not the history)."""
        config = kwargs.get("generation_config") or self.generation_config
        beams = kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1
        if beams > 1:
            raise ConfigError("num_beams", beams, f"1 ({MODEL_TYPE}: greedy or sampling)")
        return super().generate(*args, **kwargs)


def ngram_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The published checkpoint's n-gram tensors and their shapes."""
    width = config.hidden_size // config.ngram_tables
    shapes = {}
    for i, rows in enumerate(config.ngram_table_rows):
        shapes[f"model.ngram_embeddings.embedders.{i}.weight"] = (rows, width)
        shapes[f"model.ngram_embeddings.post_projs.{i}.weight"] = (config.hidden_size, width)
    return shapes


def check_tensors(headers: dict[str, tuple[int, ...]], config, where: str) -> None:
    """One line naming the first n-gram tensor of a checkpoint that is missing or mis-shaped."""
    for name, shape in ngram_tensor_shapes(config).items():
        found = headers.get(name)
        if found is None:
            raise CheckpointError(f"{where}: {name} is missing (expected shape {list(shape)})")
        if tuple(found) != shape:
            raise CheckpointError(
                f"{where}: {name} has shape {list(found)}, the config needs {list(shape)}"
            )


def register() -> None:
    """Make `longcat_flash_ngram` loadable through the Auto classes and the per-expert checkpoint
    keys fuse as LongCat-Flash's do (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    AutoConfig.register(MODEL_TYPE, LongcatFlashNgramConfig, exist_ok=True)
    AutoModel.register(LongcatFlashNgramConfig, LongcatFlashNgramModel, exist_ok=True)
    AutoModelForCausalLM.register(
        LongcatFlashNgramConfig, LongcatFlashNgramForCausalLM, exist_ok=True
    )
    register_checkpoint_conversion_mapping(
        MODEL_TYPE, get_checkpoint_conversion_mapping("longcat_flash"), overwrite=True
    )


register()
