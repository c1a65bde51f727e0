"""The packed MLA cache as a vLLM attention backend (imports vLLM: the serving venv only).

vLLM's MLA layer calls `do_kv_cache_update` with the new tokens' latent and RoPE key and their
slots, then `forward_mha` for prefill tokens (queries, latent, RoPE key) and `forward_mqa` for
decode tokens (queries already absorbed through W_UK; the layer applies W_UV to what we return).
Here each block is one page of `quantmla.memory.CacheLayout` (its bytes per token are the
memory model's, given to vLLM through `customize_spec`), the writer packs every token, the BF16
sink + recent rows live in a per-layer `ProtectionTable` whose bytes come out of vLLM's explicit
KV budget, prefill attends over the quantized history, decode reads pages + protection rows.
BF16 mode (`additional_config={"quantmla": {"precision": "bf16"}}`) is the same backend over
BF16 row pages. Chunked prefill reads a chunk's context from the pages and the protection rows
(`forward_mha`); prefix caching (exact only with the BF16 rows of every cached prefix's tail)
and speculative decoding are refused (the platform plug-in switches prefix caching off).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend, MLACommonImpl
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from quantmla.attention import PrefillContext, prefill_attention
from quantmla.errors import QuantMLAError
from quantmla.memory import CacheLayout
from quantmla.serving.paged_attention import (
    context_reader,
    decode_latent,
    decode_latent_rows,
    page_storage,
    row_reader,
    write_packed,
    write_rows,
)
from quantmla.serving.platform import PREFIX_CACHING_REFUSED, TAKEN
from quantmla.serving.protection import ProtectionTable
from quantmla.serving.settings import (
    BLOCK_SIZES,
    SERVABLE_WIDTHS,
    ServeSettings,
    check_block_size,
    check_geometry,
    protection_budget,
    resolve_settings,
)
from quantmla_kernels.paged_cache import ops

CONTEXT_CHUNK = 8192  # context tokens per read when vLLM gives no workspace


@dataclass(frozen=True)
class Served:
    """What every layer of one engine shares: settings, geometry, layers, slots, device."""

    settings: ServeSettings
    d_c: int
    d_r: int
    layers: int
    block_size: int
    max_num_seqs: int
    device: torch.device

    @property
    def layout(self) -> CacheLayout:
        return self.settings.layout(self.d_c, self.d_r, self.block_size)

    @property
    def kernel(self) -> str:
        return ops.resolve(self.settings.kernel, self.device)


_SERVED = "_quantmla_served"  # attribute on a VllmConfig: its engine's Served
_TAKEN = (
    "_quantmla_protection_bytes"  # attribute on a CacheConfig: protection taken from its budget
)
_last_config = None  # weakref to the config whose model this process loaded last


def start_up_checks(config) -> Served:
    """Every start-up refusal in one line, then the explicit KV budget minus the protection."""
    global _last_config
    if getattr(config, _SERVED, None) is not None:
        return getattr(config, _SERVED)
    hf = config.model_config.hf_config
    d_c, d_r = hf.kv_lora_rank, hf.qk_rope_head_dim
    check_geometry(d_c, d_r)
    extra = (config.additional_config or {}).get("quantmla")
    settings = resolve_settings(config.model_config.model, extra)
    sched, cache = config.scheduler_config, config.cache_config
    if cache.enable_prefix_caching:
        raise QuantMLAError(PREFIX_CACHING_REFUSED)
    if config.speculative_config is not None:
        raise QuantMLAError(
            "the QuantMLA backend decodes one token per step: no speculative decoding"
        )
    check_block_size(cache.block_size)
    layers = config.model_config.get_num_layers(config.parallel_config)
    served = Served(
        settings, d_c, d_r, layers, cache.block_size, sched.max_num_seqs,
        torch.device(config.device_config.device),
    )  # fmt: skip
    taken_by_platform = TAKEN in (config.additional_config or {})
    if (
        cache.kv_cache_memory_bytes is not None
        and not taken_by_platform
        and getattr(cache, _TAKEN, None) is None
    ):
        taken = protection_budget(
            settings, d_c, d_r, layers, sched.max_num_seqs, cache.kv_cache_memory_bytes
        )
        cache.kv_cache_memory_bytes -= taken
        object.__setattr__(cache, _TAKEN, taken)
    object.__setattr__(config, _SERVED, served)
    _last_config = weakref.ref(config)
    return served


def _current() -> Served | None:
    """The engine whose KV spec vLLM is building: the current config's, else the one whose model
    this process loaded last (vLLM asks for the spec right after loading the model)."""
    config = get_current_vllm_config_or_none()
    if config is None or getattr(config, _SERVED, None) is None:
        config = _last_config() if _last_config is not None else None
    return getattr(config, _SERVED, None) if config is not None else None


class QuantMLABackend(MLACommonBackend):
    """vLLM's common MLA scaffolding (metadata, W_UK/W_UV absorption) over the packed page layout:
    the same classes on CUDA and CPU (vLLM's GPU MLA backends build on them too)."""

    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]  # the cache format is ours (quantmla.precision)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SERVABLE_WIDTHS)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size in BLOCK_SIZES

    @staticmethod
    def get_name() -> str:
        return "QUANTMLA"

    @staticmethod
    def get_impl_cls() -> type[QuantMLAImpl]:
        return QuantMLAImpl

    @classmethod
    def customize_spec(cls, spec):
        """Packed: uint8 pages of the memory model's bytes per token; BF16 mode: BF16 rows."""
        served = _current()
        if served is None or not isinstance(spec, MLAAttentionSpec):
            return spec
        if served.settings.quantized:
            return replace(
                spec,
                dtype=torch.uint8,
                state_content_bytes=served.settings.token_bytes(served.d_c, served.d_r),
            )
        return replace(spec, dtype=torch.bfloat16)


class QuantMLAImpl(MLACommonImpl):
    can_return_lse_for_decode = False

    def __init__(self, *args, **mla_args):
        super().__init__(*args, **mla_args)  # geometry, kv_b_proj, DCP size: no kernel choice
        self.supports_quant_query_input = False  # queries arrive unquantized
        config = get_current_vllm_config_or_none()
        if config is None:
            raise QuantMLAError("the QuantMLA backend is built inside a vLLM engine only")
        self.served = start_up_checks(config)
        s = self.served.settings
        self.layout = self.served.layout
        self.protection = None
        if s.quantized:
            self.protection = ProtectionTable(
                self.served.max_num_seqs, s.sink, s.recent, self.served.d_c + self.served.d_r,
                getattr(torch, s.protection_dtype), self.served.device,
            )  # fmt: skip
        ops.warm_up(self.served.kernel, self.served.device)  # both modes decode with the C++ op
        self._new_tokens = None  # (c, k_R) of this step, for the protection rows

    # -- writing ---------------------------------------------------------------------------------
    def do_kv_cache_update(
        self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale
    ):
        if kv_cache.numel() == 0:
            return
        k_r = k_pe.reshape(k_pe.shape[0], -1)
        self._new_tokens = (kv_c_normed, k_r)
        if self.protection is None:
            write_rows(kv_cache, slot_mapping, kv_c_normed, k_r)
        else:
            write_packed(
                page_storage(kv_cache, self.layout), self.layout, slot_mapping, kv_c_normed, k_r,
                self.served.kernel,
            )  # fmt: skip

    def _batch_blocks(self, attn_metadata) -> set[int]:
        blocks = set()
        for part in (attn_metadata.decode, attn_metadata.prefill):
            if part is not None:
                blocks.update(part.block_table[:, 0].tolist())
        return blocks

    # -- prefill ---------------------------------------------------------------------------------
    def forward_mha(
        self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
        output_scale=None,
    ):  # fmt: skip
        """Each prefill request's chunk (vLLM's chunked prefill: context = seq_len − query_len
        tokens already cached) over its own tokens, its protection rows and its pages."""
        prefill = attn_metadata.prefill
        starts = prefill.query_start_loc.tolist()
        chunked = prefill.chunked_context
        contexts = chunked.context_lens_list if chunked is not None else [0] * (len(starts) - 1)
        workspace = chunked.workspace if chunked is not None else None
        k_r = k_pe.reshape(k_pe.shape[0], -1)
        slots = None
        if self.protection is not None:
            slots = self.protection.assign(
                prefill.block_table[:, 0].tolist(), contexts, self._batch_blocks(attn_metadata)
            )
        s = self.served.settings

        def kv_b_proj(x):
            return self.kv_b_proj(x)[0]

        for r, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            context = None
            if contexts[r] or slots is not None:  # packed: the chunk is in the pages too
                context = self._context(
                    contexts[r], prefill.block_table[r], kv_c_and_k_pe_cache, workspace,
                    None if slots is None else int(slots[r]),
                )  # fmt: skip
            if slots is not None:  # after the context's rows were copied out
                rows = torch.cat([kv_c_normed[a:b], k_r[a:b]], dim=-1)
                self.protection.write(int(slots[r]), contexts[r], rows)
            output[a:b] = prefill_attention(
                q[a:b], kv_c_normed[a:b], k_r[a:b], kv_b_proj, s.spec, s.sink, s.recent,
                self.qk_nope_head_dim, self.v_head_dim, self.scale, context=context,
            ).to(output.dtype)  # fmt: skip

    def _context(self, tokens, table_row, kv_cache, workspace, slot) -> PrefillContext:
        """The cached tokens before a prefill chunk: protection rows + pages, read in chunks of
        vLLM's context workspace (less two pages, for unaligned reads); packed, the pages hold the
        chunk's own tokens too (`do_kv_cache_update` ran first)."""
        page = self.served.block_size
        limit = workspace.shape[0] if workspace is not None else CONTEXT_CHUNK
        chunk = max(page, (limit - 2 * page) // page * page)
        width = self.served.d_c + self.served.d_r
        if slot is None:  # BF16 mode: every context row is exact, in the engine's pages
            read = row_reader(kv_cache, table_row, self.served.d_c)
            return PrefillContext(tokens, torch.empty(0), torch.empty(0, width), read, chunk)
        if workspace is None or workspace.shape[-1] != width:
            workspace = torch.empty(chunk + 2 * page, width, device=kv_cache.device)
        read = context_reader(
            page_storage(kv_cache, self.layout), self.layout, table_row, workspace,
            self.served.kernel,
        )  # fmt: skip
        positions, rows = self.protection.held(slot)
        return PrefillContext(tokens, positions, rows, read, chunk, written=True)

    # -- decode ----------------------------------------------------------------------------------
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        q_lat, q_rope = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, -1], dim=-1)
        decode = attn_metadata.decode
        batch = q_lat.shape[0]
        if attn_metadata.num_decode_tokens != attn_metadata.num_decodes:
            raise QuantMLAError("the QuantMLA backend decodes one token per request and step")
        table, lens = decode.block_table[:batch], decode.seq_lens[:batch]
        if self.protection is None:
            out = decode_latent_rows(
                q_lat, q_rope, self.scale, table, lens, kv_c_and_k_pe_cache, self.kv_lora_rank,
                self.served.kernel,
            )  # fmt: skip
            return out.to(q_lat.dtype), None
        cached = (lens - 1).tolist()
        slots = self.protection.assign(
            table[:, 0].tolist(), cached, self._batch_blocks(attn_metadata)
        )
        c, k_r = self._new_tokens
        rows = torch.cat([c[:batch], k_r[:batch]], dim=-1)
        self.protection.write_next(slots, cached, rows)
        out = decode_latent(
            q_lat, q_rope, self.scale, table, lens, self.layout,
            page_storage(kv_c_and_k_pe_cache, self.layout), self.protection.buffer, slots,
            self.served.kernel,
        )  # fmt: skip
        return out.to(q_lat.dtype), None
