"""vLLM platform plug-in (entry point `vllm.platform_plugins: quantmla`): vLLM's own CPU (or CUDA)
platform, except that an MLA model served by the QuantMLA backend keeps vLLM's scheduler
defaults and is checked in the process that builds the engine's config — the user's.

vLLM's CPU platform turns chunked prefill and prefix caching off for MLA (its CPU backends cannot
read cached context); the QuantMLA backend reads its own pages, so chunked prefill stays as vLLM
set it. Prefix caching is switched off with one printed line (`PREFIX_CACHING_OFF`): a prefix hit
would need the BF16 protection rows of the `recent` tokens before the hit, which exist only
while that request lives. Every start-up refusal is raised here, before vLLM starts a worker; a
`max_num_seqs` whose protection the KV budget cannot hold is lowered with a printed line, and a
page size vLLM picked for its own MLA kernels (128 on a CPU with AMX) becomes the backend's 16.
"""

from __future__ import annotations

import sys

from quantmla.errors import QuantMLAError
from quantmla.serving.settings import (
    BLOCK_SIZES,
    DEFAULT_BLOCK_SIZE,
    check_block_size,
    check_geometry,
    fitting_num_seqs,
    protection_budget,
    resolve_settings,
)

_NO_PREFIX_REASON = (
    "a cached prefix would need the BF16 protection rows of the `recent` tokens before it, which "
    "only its own live request holds (docs/serving.md)"
)
PREFIX_CACHING_OFF = f"quantmla: prefix caching is off — {_NO_PREFIX_REASON}"
PREFIX_CACHING_REFUSED = (
    "the QuantMLA backend serves without prefix caching (enable_prefix_caching=False): "
    + _NO_PREFIX_REASON
)
TAKEN = "protection_bytes_taken"  # additional_config key: protection already out of the budget


def announce(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def serves(vllm_config, every_mla: bool) -> bool:
    """An MLA model the backend serves: on a CPU every one (it takes the place of vLLM's CPU MLA
    backends, plugin.register); on CUDA one with an export's manifest or a stated
    `additional_config["quantmla"]`."""
    from pathlib import Path

    from quantmla.checkpoint import MANIFEST

    model = vllm_config.model_config
    if model is None or not getattr(model, "use_mla", False):
        return False
    stated = "quantmla" in (vllm_config.additional_config or {})
    return every_mla or stated or (Path(model.model) / MANIFEST).is_file()


def configure(vllm_config) -> None:
    """The backend's start-up checks and scheduler settings on a fresh `VllmConfig`."""
    model, cache, sched = (
        vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config,
    )  # fmt: skip
    if vllm_config.additional_config is None:
        vllm_config.additional_config = {}
    additional = vllm_config.additional_config
    if TAKEN in additional:
        return  # checked already
    hf = model.hf_config
    d_c, d_r = hf.kv_lora_rank, hf.qk_rope_head_dim
    check_geometry(d_c, d_r)
    if cache.block_size not in BLOCK_SIZES and not cache.user_specified_block_size:
        cache.block_size = DEFAULT_BLOCK_SIZE  # e.g. the CPU platform's 128 where AMX is present
    check_block_size(cache.block_size)
    settings = resolve_settings(model.model, additional.get("quantmla"))
    if vllm_config.speculative_config is not None:
        raise QuantMLAError(
            "the QuantMLA backend decodes one token per request and step: no speculative decoding"
        )
    if cache.enable_prefix_caching:
        cache.enable_prefix_caching = False
        announce(PREFIX_CACHING_OFF)
    taken = 0
    if cache.kv_cache_memory_bytes is not None and settings.quantized:
        layers = model.get_num_layers(vllm_config.parallel_config)
        fits = fitting_num_seqs(
            settings, d_c, d_r, layers, cache.kv_cache_memory_bytes, model.max_model_len,
            cache.block_size,
        )  # fmt: skip
        if sched.max_num_seqs > fits:
            announce(
                f"quantmla: max_num_seqs {sched.max_num_seqs} -> {fits}: the BF16 protection of "
                f"more requests would leave kv_cache_memory_bytes={cache.kv_cache_memory_bytes} "
                f"no room for one {model.max_model_len}-token request"
            )
            sched.max_num_seqs = fits
        taken = protection_budget(
            settings, d_c, d_r, layers, sched.max_num_seqs, cache.kv_cache_memory_bytes
        )
        cache.kv_cache_memory_bytes -= taken
    additional[TAKEN] = taken


def _platform(base, every_mla: bool):
    class QuantMLAPlatform(base):
        """`base` with the QuantMLA backend's scheduler settings and start-up checks."""

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
            kept = (
                sched.enable_chunked_prefill, sched.max_num_batched_tokens,
                cache.enable_prefix_caching,
            )  # fmt: skip
            super().check_and_update_config(vllm_config)
            if serves(vllm_config, every_mla):  # vLLM's settings, then the backend's
                sched.enable_chunked_prefill, sched.max_num_batched_tokens = kept[:2]
                cache.enable_prefix_caching = kept[2]
                configure(vllm_config)

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
            from vllm.config import get_current_vllm_config_or_none

            from quantmla.serving.plugin import BACKEND

            config = get_current_vllm_config_or_none()
            mla = getattr(attn_selector_config, "use_mla", False)
            if mla and config is not None and serves(config, every_mla):
                return BACKEND
            return super().get_attn_backend_cls(
                selected_backend, attn_selector_config, *args, **kwargs
            )

    QuantMLAPlatform.__name__ = QuantMLAPlatform.__qualname__ = f"QuantMLA{base.__name__}"
    return QuantMLAPlatform


def _cpu():
    from vllm.platforms.cpu import CpuPlatform

    return _platform(CpuPlatform, every_mla=True)


def _cuda():
    from vllm.platforms.cuda import CudaPlatform

    return _platform(CudaPlatform, every_mla=False)


def __getattr__(name: str):
    """`QuantMLACpuPlatform` / `QuantMLACudaPlatform`, built on first use (vLLM imports the
    platform class by this module path; the base classes import vLLM, which this module must not
    at import time: the plug-in runs while vLLM resolves its platform)."""
    makers = {"QuantMLACpuPlatform": _cpu, "QuantMLACudaPlatform": _cuda}
    if name not in makers:
        raise AttributeError(name)
    cls = makers[name]()
    globals()[name] = cls
    return cls
