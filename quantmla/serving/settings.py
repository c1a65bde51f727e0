"""What the serving backend caches, and how many bytes that takes (no vLLM import: testable in
the project's venv).

The cache format comes from the export's `quantmla.json` (quantizer spec + protection window);
`additional_config={"quantmla": {...}}` may override fields; a stated `precision` needs no
manifest (`{"precision": "bf16"}` is the BF16 mode of the same backend, the like-for-like
baseline; `{"precision": "c4r4"}` on a plain checkpoint is RTN). Every check answers in one line at start-up, before vLLM allocates anything.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from quantmla.errors import ConfigError, QuantMLAError
from quantmla.memory import CacheLayout
from quantmla.quant import PACKABLE_BITS
from quantmla.spec import KERNELS, META_DTYPE_BYTES, SPEC_FIELDS, QuantizerSpec

# Latent + RoPE widths vLLM's MLA layer accepts (MLACommonBackend.get_supported_head_sizes).
SERVABLE_WIDTHS = (320, 512, 576)
PROTECTION_DTYPES = ("bfloat16", "float32")
BLOCK_SIZES = (16, 32, 64)  # powers of two: the Triton decode tiles one page
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ServeSettings:
    """The cache one served model uses: precision, quantizer fields, protection and its dtype."""

    precision: str = "bf16"
    group_size: int = 64
    content_meta_dtype: str = "bfloat16"
    rope_meta_dtype: str = "float32"
    sink: int = 4
    recent: int = 128
    protection_dtype: str = "bfloat16"  # BF16 as in the memory model; float32 for fp32 checks
    kernel: str = "auto"  # auto: Triton on CUDA, the vectorized torch path on CPU

    def __post_init__(self):
        spec = self.spec  # validates precision, group size, metadata dtypes
        if not spec.packable:
            raise ConfigError(
                "quantmla.precision", self.precision,
                "integer codes: FP8, FP4 and codebook paths are simulated, not packed",
            )  # fmt: skip
        if spec.quantized:
            for name, bits in (("content", spec.content_bits), ("rope", spec.rope_bits)):
                if bits not in PACKABLE_BITS:
                    raise ConfigError(
                        f"quantmla.precision ({name} bits)",
                        self.precision,
                        f"precisions whose both paths the packed cache holds: bits in {PACKABLE_BITS} "
                        "(e.g. c4r4, c2r4, c8r8), or bf16",
                    )
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"quantmla.{name}", value, "an integer >= 0")
        if self.protection_dtype not in PROTECTION_DTYPES:
            raise ConfigError("quantmla.protection_dtype", self.protection_dtype, PROTECTION_DTYPES)
        if self.kernel not in KERNELS:
            raise ConfigError("quantmla.kernel", self.kernel, KERNELS)

    @property
    def spec(self) -> QuantizerSpec:
        return QuantizerSpec.from_precision(
            self.precision, **{f: getattr(self, f) for f in SPEC_FIELDS}
        )

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    def layout(self, d_c: int, d_r: int, page_tokens: int) -> CacheLayout:
        """The packed layout with one engine block as one page."""
        layout = CacheLayout(self.spec, d_c, d_r, self.sink, self.recent, page_tokens)
        self.spec.check_dims(d_c, d_r)
        return layout

    def token_bytes(self, d_c: int, d_r: int) -> int:
        """Bytes per token and layer in an engine page (the memory model's)."""
        return CacheLayout(self.spec, d_c, d_r).token_bytes()

    def protection_bytes(self, d_c: int, d_r: int) -> int:
        """One request's protection buffer in one layer (0 in BF16 mode)."""
        if not self.quantized:
            return 0
        return (self.sink + self.recent) * (d_c + d_r) * META_DTYPE_BYTES[self.protection_dtype]


def check_block_size(block_size: int) -> None:
    """Pages the backend's kernels tile; one line before vLLM starts a worker."""
    if block_size not in BLOCK_SIZES:
        raise ConfigError("block_size", block_size, BLOCK_SIZES)


def check_geometry(d_c: int, d_r: int) -> None:
    """vLLM's MLA serves only a few latent + RoPE widths; say so before it loads weights."""
    if d_c + d_r not in SERVABLE_WIDTHS:
        raise ConfigError(
            "kv_lora_rank + qk_rope_head_dim",
            f"{d_c} + {d_r} = {d_c + d_r}",
            f"a width vLLM's MLA layer serves: {SERVABLE_WIDTHS} (e.g. tiny-mla-v2's 256 + 64; "
            "tiny-mla's 128 + 64 cannot be served)",
        )


def resolve_settings(model_dir: str | Path, extra: dict | None) -> ServeSettings:
    """The export's manifest, overridden by `additional_config["quantmla"]`; a stated `precision`
    needs none (BF16 mode, or RTN on a plain checkpoint)."""
    from quantmla.checkpoint import MANIFEST, load_manifest

    extra = dict(extra or {})
    allowed = {f.name for f in fields(ServeSettings)}
    unknown = sorted(set(extra) - allowed)
    if unknown:
        raise ConfigError("additional_config.quantmla", unknown, sorted(allowed))
    if "precision" in extra and not (Path(model_dir) / MANIFEST).is_file():
        return ServeSettings(**extra)  # a stated format: RTN on a plain checkpoint, or BF16 mode
    manifest = load_manifest(model_dir)
    q = manifest["quantizer"]
    base = {
        "precision": manifest["precision"],
        "group_size": q["group_size"],
        "content_meta_dtype": q["content_meta_dtype"],
        "rope_meta_dtype": q["rope_meta_dtype"],
        **manifest["protection"],
    }
    return ServeSettings(**{**base, **extra})


def protection_budget(
    settings: ServeSettings, d_c: int, d_r: int, layers: int, max_num_seqs: int, kv_bytes: int
) -> int:
    """Bytes the protection buffers take out of an explicit KV budget (`max_num_seqs` requests in
    every layer); one line if the budget cannot hold even one request's protection."""
    one = settings.protection_bytes(d_c, d_r) * layers
    if not one:
        return 0
    if kv_bytes < one:
        raise QuantMLAError(
            f"kv_cache_memory_bytes={kv_bytes} is smaller than one request's BF16 protection "
            f"({settings.sink} + {settings.recent} tokens x {layers} layers = {one} B); "
            "raise the budget or shrink quantmla.sink/recent"
        )
    total = one * max_num_seqs
    if kv_bytes <= total:
        raise QuantMLAError(
            f"kv_cache_memory_bytes={kv_bytes} leaves no pages after the protection of "
            f"max_num_seqs={max_num_seqs} requests ({total} B); lower max_num_seqs to at most "
            f"{max(1, (kv_bytes - 1) // one)} or raise the budget"
        )
    return total


def fitting_num_seqs(
    settings: ServeSettings, d_c: int, d_r: int, layers: int, kv_bytes: int, max_model_len: int,
    block_size: int,
) -> int:  # fmt: skip
    """The most requests whose protection leaves an explicit budget pages for one
    `max_model_len`-token request (what vLLM requires); one line if not even one request fits
    (in BF16 mode, no protection: if the budget cannot hold that request's pages)."""
    one = settings.protection_bytes(d_c, d_r) * layers  # 0 in BF16 mode: no protection
    request = -(-max_model_len // block_size) * block_size * settings.token_bytes(d_c, d_r) * layers
    if kv_bytes < request + one:
        protection = f" and its BF16 protection ({one} B)" if one else ""
        raise QuantMLAError(
            f"kv_cache_memory_bytes={kv_bytes} cannot hold one {max_model_len}-token request "
            f"({request} B of pages){protection}; raise the budget to at least {request + one} "
            "or lower max_model_len"
        )
    return int((kv_bytes - request) // one) if one else sys.maxsize


def predicted_capacity(
    settings: ServeSettings,
    d_c: int,
    d_r: int,
    layers: int,
    block_size: int,
    kv_bytes: int,
    max_num_seqs: int,
) -> int:
    """Tokens an engine can hold at an explicit KV budget: whole blocks of `block_size` tokens in
    every layer, after the protection buffers (the memory model's bytes)."""
    pages = kv_bytes - protection_budget(settings, d_c, d_r, layers, max_num_seqs, kv_bytes)
    block = settings.token_bytes(d_c, d_r) * block_size * layers
    return math.floor(pages / block) * block_size


def check_served_family(model_type: str | None, field: str) -> None:
    """LongCat-Flash-Lite's n-gram front end exists in vLLM only as a CUDA op under its Model-Runner-V2
    (`LongcatFlashNgramForCausalLM`): one line on a machine without CUDA."""
    import torch

    if model_type == "longcat_flash_ngram" and not torch.cuda.is_available():
        raise ConfigError(
            field,
            "longcat_flash_ngram",
            "a model vLLM runs without CUDA (vLLM computes LongCat-Flash-Lite's n-gram ids with a "
            "CUDA op under its Model-Runner-V2); evaluate it here with eval.engine=hf",
        )


def check_servable(serve_python, model_config, policy, field: str) -> None:
    """A job that serves its model through vLLM, before anything loads: the serving venv exists,
    vLLM's MLA serves the latent width, the writer packs the precision (one line each)."""
    if serve_python is None or not Path(serve_python).is_file():
        raise QuantMLAError(
            f"{field}: paths.serve_python={serve_python} does not exist; run `make serve-setup` "
            "(vLLM in .venv-serve) or point paths.serve_python at a python with vLLM and quantmla"
        )
    if model_config is not None:
        check_geometry(model_config.kv_lora_rank, model_config.qk_rope_head_dim)
        check_served_family(getattr(model_config, "model_type", None), field)
    ServeSettings(policy.precision, policy.group_size, sink=policy.sink, recent=policy.recent)
