"""The cache writer: quantize (the one quantizer), pack, and insert tokens through a request's page
table; prefill (many tokens) and decode (one) are the same call. Protected tokens (the first
`sink`, and a ring of the last `recent`) are also copied to the request's BF16 buffer, and every
token is packed, so a token leaving the recent window needs no rewrite.

`write_tokens(..., backend="torch")` runs the reference (`reference.write_reference`, built on the
one quantizer); `backend="triton"` is one fused kernel per token whose codes, scales and zeros are
bit-identical to it (tests/test_paged_kernels.py). Both stop before anything is written on non-finite input
(the simulator's `NonFiniteCacheError`) or a pool without room (`PoolExhaustedError`)."""

from __future__ import annotations

import torch

from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.quant import SCALE_FLOOR
from quantmla_kernels.paged_cache.launch import launch
from quantmla_kernels.paged_cache.layout import (
    check_packable,
    kept_in_protection,
    layout_constants,
    protection_slots,
)
from quantmla_kernels.paged_cache.pool import PagePool
from quantmla_kernels.paged_cache.reference import write_reference

WRITER_BACKENDS = ("torch", "triton")

try:  # the fused kernels need Triton (a GPU, or TRITON_INTERPRET=1 on CPU)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None


def _destinations(pool: PagePool, request_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical page, slot) of the request's last `n` tokens."""
    request = pool.request(request_id)
    pos = torch.arange(request.tokens - n, request.tokens)
    table = request.page_table()
    page = pool.layout.page_tokens
    return table[pos // page].to(pool.device), (pos % page).to(pool.device)


def _write_protection(pool: PagePool, request_id: int, c, k_r) -> None:
    """First `sink` tokens at their position; others in the ring slot sink + pos % recent."""
    layout, request = pool.layout, pool.request(request_id)
    if not layout.quantized:
        return
    n = c.shape[0]
    pos = torch.arange(request.tokens - n, request.tokens)
    rows = torch.cat([c, k_r], dim=-1).to(request.protection.dtype)
    keep = kept_in_protection(pos, request.tokens, layout.sink, layout.recent)
    slot = protection_slots(pos, layout.sink, layout.recent)
    request.protection[slot[keep].to(request.protection.device)] = rows[keep].to(
        request.protection.device
    )


def write_tokens(
    pool: PagePool, request_id: int, c: torch.Tensor, k_r: torch.Tensor, backend: str = "torch"
) -> None:
    """Append `c` (n, d_c) and `k_r` (n, d_r) to a request: all or nothing."""
    layout = pool.layout
    check_packable(layout)
    if c.shape[-1] != layout.d_c or k_r.shape[-1] != layout.d_r or c.shape[0] != k_r.shape[0]:
        raise ConfigError(
            "writer input shapes",
            (tuple(c.shape), tuple(k_r.shape)),
            f"(n, {layout.d_c}), (n, {layout.d_r})",
        )
    for name, t in (("c", c), ("k_R", k_r)):
        bad = ~torch.isfinite(t).all(dim=-1)
        if bad.any():
            raise NonFiniteCacheError(
                f"request {request_id}: {name} has NaN/Inf at new token(s) "
                f"{bad.nonzero().flatten().tolist()[:8]}; nothing was written"
            )
    if backend not in WRITER_BACKENDS:
        raise ConfigError("writer backend", backend, WRITER_BACKENDS)
    n = c.shape[0]
    pool.reserve(request_id, n)  # raises before anything is written
    pages, slots = _destinations(pool, request_id, n)
    write_slots(pool.storage, layout, pages, slots, c, k_r, backend)
    _write_protection(pool, request_id, c, k_r)


def write_slots(storage, layout, pages, slots, c, k_r, backend: str = "torch") -> None:
    """Pack token rows `c` (n, d_c), `k_r` (n, d_r) into (page, slot) of `storage` (n_pages,
    page_bytes) uint8: the writer without a pool, for caches whose page tables live elsewhere
    (an engine's block tables)."""
    if backend == "torch":
        write_reference(storage, layout, pages, slots, c, k_r)
    elif backend == "triton":
        _write_triton(storage, layout, pages, slots, c, k_r)
    else:
        raise ConfigError("writer backend", backend, WRITER_BACKENDS)


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


def _write_triton(storage, layout, pages, slots, c, k_r) -> None:
    if triton is None:  # pragma: no cover
        raise RuntimeError("backend=triton needs the triton package")
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
