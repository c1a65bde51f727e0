"""Triton device functions the cache's kernels share: one packed page tile unpacked and scaled in
registers (the decode kernel and the context gather read pages through it)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None

# rows of a page dequantized and attended at once: a 16 × d_c tile keeps the kernel in registers
# (a whole 64-token page at d_c 512 spilled on sm_80/sm_90: results/kernels_compile.json)
DECODE_TILE = 16

if triton is not None:

    @triton.jit
    def load_meta(ptr, index, META_BYTES: tl.constexpr):
        """Little-endian BF16 (2 bytes) or FP32 (4 bytes) values at byte `index` → fp32."""
        word = tl.load(ptr + index).to(tl.uint32)
        for k in tl.static_range(1, META_BYTES):
            word = word | (tl.load(ptr + index + k).to(tl.uint32) << (8 * k))
        if META_BYTES == 2:
            word = word << 16
        return word.to(tl.float32, bitcast=True)

    @triton.jit
    def dequant_tile(
        ptr,
        page_base,
        rows,
        DIM: tl.constexpr,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        WORD_BYTES: tl.constexpr,
        META_BYTES: tl.constexpr,
        CODES_AT: tl.constexpr,
        SCALES_AT: tl.constexpr,
        ZEROS_AT: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """(TILE, DIM) fp32 ĉ = (q − z)·s of one page's rows: unpacked and scaled in registers."""
        PER_WORD: tl.constexpr = 8 * WORD_BYTES // BITS  # codes in one packed word
        GROUPS: tl.constexpr = DIM // GROUP
        MASK: tl.constexpr = (1 << BITS) - 1
        nw = tl.arange(0, DIM // PER_WORD)
        j = tl.arange(0, PER_WORD)
        at = (
            ptr
            + page_base
            + CODES_AT
            + rows[:, None] * (DIM * BITS // 8)
            + nw[None, :] * WORD_BYTES
        )
        word = tl.load(at).to(tl.int32)
        for k in tl.static_range(1, WORD_BYTES):  # little-endian bytes of the word
            word = word | (tl.load(at + k).to(tl.int32) << (8 * k))
        codes = (word[:, :, None] >> (j[None, None, :] * BITS)) & MASK
        codes = codes.to(tl.float32)
        g = tl.arange(0, GROUPS)
        meta_at = page_base + rows[:, None] * (GROUPS * META_BYTES) + g[None, :] * META_BYTES
        scale = load_meta(ptr, SCALES_AT + meta_at, META_BYTES)  # (TILE, GROUPS)
        zero = tl.load(ptr + page_base + ZEROS_AT + rows[:, None] * GROUPS + g[None, :]).to(
            tl.float32
        )
        codes = tl.reshape(codes, (TILE, GROUPS, GROUP))  # the metadata broadcast, not copied
        return tl.reshape((codes - zero[:, :, None]) * scale[:, :, None], (TILE, DIM))
