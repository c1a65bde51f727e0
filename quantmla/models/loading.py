"""Loading MLA models: real checkpoints (local path or hub id), random-init models from published
configs shrunk for tests, and the project's tiny model. Never `trust_remote_code` unless asked.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import torch

from quantmla.errors import ConfigError
from quantmla.models.adapters import ADAPTERS, MODEL_TYPE_ALIASES
from quantmla.paths import check_safetensors, local_config_json

# Published model_types with no transformers class: ours, registered with the Auto classes on
# import; each module's `check_tensors(shapes, config, where)` checks a checkpoint's own tensors.
OWN_FAMILIES = {"longcat_flash_ngram": "quantmla.models.longcat_ngram"}
_DROP_KEYS = ("auto_map", "quantization_config", "transformers_version", "architectures")


def config_from_dict(raw: dict, keep_quantization: bool = False):
    """A transformers config from a published config.json dict, aliases remapped; its
    `quantization_config` (an FP8 checkpoint's) only when `keep_quantization`."""
    from transformers import AutoConfig

    drop = set(_DROP_KEYS) - ({"quantization_config"} if keep_quantization else set())
    fields = {k: v for k, v in raw.items() if k not in drop}
    model_type = fields.pop("model_type", None)
    model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type not in ADAPTERS:
        raise ConfigError(
            "model_type", raw.get("model_type"), sorted(ADAPTERS) + sorted(MODEL_TYPE_ALIASES)
        )
    if model_type in OWN_FAMILIES:
        importlib.import_module(OWN_FAMILIES[model_type])
    return AutoConfig.for_model(model_type, **fields)


def config_from_file(path: str | os.PathLike):
    return config_from_dict(json.loads(Path(path).read_text()))


def checkpoint_config(path_or_id: str):
    """The transformers config of a local checkpoint folder, None for a hub id."""
    found = local_config_json(path_or_id)
    return config_from_file(found) if found is not None else None


def check_checkpoint(path_or_id: str) -> None:
    """A local checkpoint's safetensors files are whole, and its family's own tensors (LongCat-Flash-
    Lite's n-gram tables) are there with their shapes: one line naming the file or tensor, from the
    headers alone, before anything loads (transformers would initialise a missing table at random)."""
    shapes = check_safetensors(path_or_id)  # a hub id is no folder: nothing to check
    found = local_config_json(path_or_id)
    if not shapes or found is None:
        return
    raw = json.loads(found.read_text())
    family = OWN_FAMILIES.get(raw.get("model_type"))
    if family is not None:
        importlib.import_module(family).check_tensors(
            shapes, config_from_dict(raw), str(path_or_id)
        )


def shrink_config(
    config,
    num_layers: int = 2,
    vocab_size: int = 256,
    max_heads: int = 16,
    n_experts: int = 4,
    ffn_size: int = 64,
    dtype: torch.dtype = torch.float32,
    ngram_ratio: int = 4,
):
    """Fewer layers, experts, vocab, FFN width (and n-gram rows); MLA dims and RoPE untouched.

    Heads are capped at `max_heads` (the 64/128-head models), everything else of attention is kept.
    Layer 0 stays dense and layer 1 MoE, so both MLP kinds run.
    """
    c = config
    if c.model_type.startswith("longcat_flash"):
        c.num_layers = max(1, num_layers // 2)  # two MLA blocks per decoder layer
        c.ffn_hidden_size = c.expert_ffn_hidden_size = ffn_size
        c.moe_topk = min(2, n_experts)
        c.zero_expert_num = min(getattr(c, "zero_expert_num", 0) or 0, 2)
        if getattr(c, "ngram_vocab_size_ratio", None):  # n-gram tables of 4·vocab rows, not 78·
            c.ngram_vocab_size_ratio = min(c.ngram_vocab_size_ratio, ngram_ratio)
    else:
        c.num_hidden_layers = num_layers
        c.intermediate_size = c.moe_intermediate_size = ffn_size
        c.num_experts_per_tok = min(2, n_experts)
        c.first_k_dense_replace = 1
        if hasattr(c, "mlp_layer_types"):
            c.mlp_layer_types = ["dense"] + ["sparse"] * (num_layers - 1)
        for name in ("n_group", "topk_group"):
            if getattr(c, name, None) is not None:
                setattr(c, name, 1)
        c.num_nextn_predict_layers = 0
    c.n_routed_experts = n_experts
    c.vocab_size = vocab_size
    if c.num_attention_heads > max_heads:
        c.num_attention_heads = c.num_key_value_heads = max_heads
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(c, name, None)
        if value is not None and (isinstance(value, list) or value >= vocab_size):
            setattr(c, name, None if name == "pad_token_id" else 0)
    c.dtype = dtype
    return c


def random_model_from_config_file(
    path: str | os.PathLike, seed: int = 0, experts_implementation: str | None = None, **shrink
):
    """A random-init, shrunk model from a published config.json (tests and benchmarks).

    `experts_implementation="eager"` runs MoE experts in any dtype (grouped_mm has no float64).
    """
    from transformers import AutoModelForCausalLM

    config = shrink_config(config_from_file(path), **shrink)
    torch.manual_seed(seed)
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    return AutoModelForCausalLM.from_config(config, dtype=config.dtype, **extra).eval()


def load_pretrained(
    path_or_id: str,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    device: str = "cpu",
    fp8: str = "dequantize",
):
    """A checkpoint (local folder or hub id) and its tokenizer; `kimi_k2` loads as DeepSeek-V3.
    `device="auto"` shards the model over every visible GPU (device_map="auto"). An FP8
    block-quantized local checkpoint loads with `fp8="native"` through transformers' fine-grained
    FP8 layers (CUDA only), or with `fp8="dequantize"` as BF16 (our dequantization, see
    `quantmla.models.fp8.dequantize_checkpoint`)."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.models.fp8 import dequantize_checkpoint
    from quantmla.models.sizes import is_fp8_checkpoint

    check_checkpoint(path_or_id)
    found = local_config_json(path_or_id)
    raw = json.loads(found.read_text()) if found is not None else {}
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    placement = {"device_map": "auto"} if device == "auto" else {}  # "auto": shard over all GPUs
    source, scratch = path_or_id, None
    if is_fp8_checkpoint(raw) and fp8 == "native":
        if not torch.cuda.is_available():
            raise ConfigError(
                "model.fp8", fp8, "dequantize on a machine without CUDA (FP8 matmuls need a GPU)"
            )
        config = config_from_dict(raw, keep_quantization=True)
        if device.startswith("cuda"):  # transformers places FP8 layers while loading
            placement = {"device_map": device}
    elif is_fp8_checkpoint(raw):
        scratch = tempfile.TemporaryDirectory(prefix="quantmla-dequantized-")
        source = str(dequantize_checkpoint(path_or_id, scratch.name))
        config = checkpoint_config(source)
        torch_dtype = torch.bfloat16 if dtype == "auto" else torch_dtype
    else:
        config = checkpoint_config(path_or_id)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            **placement,
        )
    finally:
        if scratch is not None:
            scratch.cleanup()
    if device != "auto":
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
    return use_padded_sdpa(model.eval()), tokenizer


PADDED_SDPA = "sdpa_padded_values"  # transformers' SDPA with values padded to the key width


def use_padded_sdpa(model):
    """Attention through `quantmla.attention.sdpa` where an MLA model's values are narrower than its
    keys and it runs transformers' SDPA: the same function, CPU flash kernel instead of the math
    fallback (a 2,048-token SmolLM2-MLA window: 16.6 s → ~7 s on 2 cores)."""
    from transformers import AttentionInterface
    from transformers.integrations import sdpa_attention
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    narrower = getattr(config, "v_head_dim", None) not in (None, getattr(config, "qk_head_dim", 0))
    if not narrower or config._attn_implementation != "sdpa":
        return model
    if PADDED_SDPA not in AttentionInterface._global_mapping:

        def padded(module, query, key, value, attention_mask, **kwargs):
            d_v = value.shape[-1]
            if query.device.type != "cpu" or d_v == query.shape[-1]:
                return sdpa_attention.sdpa_attention_forward(
                    module, query, key, value, attention_mask, **kwargs
                )
            value = torch.nn.functional.pad(value, (0, query.shape[-1] - d_v))
            out, weights = sdpa_attention.sdpa_attention_forward(
                module, query, key, value, attention_mask, **kwargs
            )
            return out[..., :d_v], weights

        AttentionInterface.register(PADDED_SDPA, padded)
        AttentionMaskInterface.register(PADDED_SDPA, sdpa_mask)
    model.set_attn_implementation(PADDED_SDPA)
    return model
