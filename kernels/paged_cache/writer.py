"""The cache writers: quantize (the one quantizer), pack and scatter token rows to (page, slot) of
a page store. `write_torch` is built on `quantmla.quant`; `write_triton` is one fused kernel per
token whose codes, scales and zeros are bit-identical to it (tests/test_paged_kernels.py). Callers
go through `ops.write` / `ops.write_tokens`, which validate the input and pick one."""

from __future__ import annotations

import torch

from quantmla.memory import CacheLayout
from quantmla.quant import SCALE_FLOOR, pack, quantize
from quantmla_kernels.paged_cache.launch import launch
from quantmla_kernels.paged_cache.layout import layout_constants, paths

try:  # the fused kernels need Triton (a GPU, or TRITON_INTERPRET=1 on CPU)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None


def token_bytes(layout: CacheLayout, c: torch.Tensor, k_r: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each section's bytes per token, (n, bytes) uint8, from the one quantizer."""
    out = {}
    for path, x in zip(paths(layout), (c, k_r)):
        q = quantize(x.float(), path.bits, layout.spec.group_size, path.meta_dtype)
        out[f"{path.name}_codes"] = pack(q.codes.flatten(-2), path.bits)
        out[f"{path.name}_scales"] = q.scale.flatten(-2).contiguous().view(torch.uint8)
        out[f"{path.name}_zeros"] = q.zero.flatten(-2).to(torch.uint8)
    return out


def write_torch(storage: torch.Tensor, layout: CacheLayout, pages, slots, c, k_r) -> None:
    """The torch writer: each token's section bytes scattered to (page, slot) of `storage`
    (n_pages, page_bytes) uint8 — a pool's, or an engine's block tensor viewed as pages."""
    pages, slots = pages.to(storage.device, torch.int64), slots.to(storage.device, torch.int64)
    sections, tokens = layout.sections(), layout.page_tokens
    for name, data in token_bytes(layout, c, k_r).items():
        start, row = sections[name][0], data.shape[-1]
        section = storage[:, start : start + tokens * row].view(-1, tokens, row)
        section[pages, slots] = data.to(storage.device)


# ------------------------------------------------------------------------------------- Triton

if triton is not None:
    _SCALE_FLOOR = tl.constexpr(SCALE_FLOOR)

    @triton.jit
    def _rne(v):
        """Round half to even (torch.round) in fp32; v - floor(v) is exact for codes' range."""
        r = tl.floor(v)
        frac = v - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def _quantize_pack_store(
        x_ptr,
        out_ptr,
        page_base,
        slot,
        DIM: tl.constexpr,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        META_BYTES: tl.constexpr,
        CODES_AT: tl.constexpr,
        SCALES_AT: tl.constexpr,
        ZEROS_AT: tl.constexpr,
    ):
        PER_WORD: tl.constexpr = 8 * WORD_BYTES // BITS  # codes in one packed word
        GROUP_WORDS: tl.constexpr = GROUP // PER_WORD
        GROUPS: tl.constexpr = DIM // GROUP
        LEVELS: tl.constexpr = (1 << BITS) - 1
        g = tl.arange(0, GROUPS)
        b = tl.arange(0, GROUP_WORDS)
        j = tl.arange(0, PER_WORD)
        index = g[:, None, None] * GROUP + b[None, :, None] * PER_WORD + j[None, None, :]
        x = tl.load(x_ptr + index).to(tl.float32)
        lo = tl.minimum(tl.min(tl.min(x, axis=2), axis=1), 0.0)
        hi = tl.maximum(tl.max(tl.max(x, axis=2), axis=1), 0.0)
        scale = tl.maximum(tl.math.div_rn(hi - lo, LEVELS * 1.0), _SCALE_FLOOR)
        zero = _rne(tl.math.div_rn(-lo, scale))  # with the unrounded scale, as the quantizer
        bits32 = scale.to(tl.uint32, bitcast=True)
        if META_BYTES == 2:  # BF16 metadata: round to nearest even on the top 16 bits
            bits32 = (bits32 + 0x7FFF + ((bits32 >> 16) & 1)) & 0xFFFF0000
            scale = bits32.to(tl.float32, bitcast=True)
        s3 = scale[:, None, None]
        codes = _rne(tl.math.div_rn(x, s3)) + zero[:, None, None]
        codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.int32)
        packed = tl.sum(codes << (j[None, None, :] * BITS), axis=2)  # (GROUPS, GROUP_WORDS)
        row = page_base + slot * (DIM * BITS // 8)
        offs = (g[:, None] * GROUP_WORDS + b[None, :]) * WORD_BYTES
        for k in tl.static_range(WORD_BYTES):  # the word's bytes, little-endian
            tl.store(out_ptr + row + CODES_AT + offs + k, ((packed >> (8 * k)) & 0xFF).to(tl.uint8))
        meta_row = page_base + slot * (GROUPS * META_BYTES) + SCALES_AT + g * META_BYTES
        word = bits32 >> (32 - 8 * META_BYTES)  # the stored bytes, little-endian
        for k in tl.static_range(META_BYTES):
            tl.store(out_ptr + meta_row + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8))
        tl.store(out_ptr + page_base + slot * GROUPS + ZEROS_AT + g, zero.to(tl.uint8))

    @triton.jit
    def _writer_kernel(
        c_ptr,
        k_ptr,
        page_ptr,
        slot_ptr,
        out_ptr,
        PAGE_BYTES: tl.constexpr,
        GROUP: tl.constexpr,
        D_C: tl.constexpr,
        C_BITS: tl.constexpr,
        C_WORD: tl.constexpr,
        C_META: tl.constexpr,
        C_CODES: tl.constexpr,
        C_SCALES: tl.constexpr,
        C_ZEROS: tl.constexpr,
        D_R: tl.constexpr,
        R_BITS: tl.constexpr,
        R_WORD: tl.constexpr,
        R_META: tl.constexpr,
        R_CODES: tl.constexpr,
        R_SCALES: tl.constexpr,
        R_ZEROS: tl.constexpr,
    ):
        t = tl.program_id(0)
        page_base = tl.load(page_ptr + t).to(tl.int64) * PAGE_BYTES  # int64: pools pass 2^31 B
        slot = tl.load(slot_ptr + t).to(tl.int64)
        _quantize_pack_store(
            c_ptr + t * D_C,
            out_ptr,
            page_base,
            slot,
            D_C,
            GROUP,
            C_BITS,
            C_WORD,
            C_META,
            C_CODES,
            C_SCALES,
            C_ZEROS,
        )
        _quantize_pack_store(
            k_ptr + t * D_R,
            out_ptr,
            page_base,
            slot,
            D_R,
            GROUP,
            R_BITS,
            R_WORD,
            R_META,
            R_CODES,
            R_SCALES,
            R_ZEROS,
        )


def write_triton(storage, layout, pages, slots, c, k_r) -> None:
    if triton is None:  # pragma: no cover
        raise RuntimeError("kernel=triton needs the triton package")
    launch(
        _writer_kernel,
        (c.shape[0],),
        c.float().contiguous(),
        k_r.float().contiguous(),
        pages.to(torch.int64).contiguous(),
        slots.to(torch.int64).contiguous(),
        storage,
        **layout_constants(layout),
    )
