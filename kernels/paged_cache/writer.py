"""The cache writer: quantize (the one quantizer), pack, and insert tokens through a request's page
table; prefill (many tokens) and decode (one) are the same call. Protected tokens (the first
`sink`, and a ring of the last `recent`) are also copied to the request's BF16 buffer, and every
token is packed, so a token leaving the recent window needs no rewrite.

`write_tokens(..., backend="torch")` is the reference, built on `quantmla.quant.quantize`/`pack`;
`backend="triton"` is one fused kernel per token whose codes, scales and zeros are bit-identical
to it (tests/test_paged_kernels.py). Both stop before anything is written on non-finite input
(the simulator's `NonFiniteCacheError`) or a pool without room (`PoolExhaustedError`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_cache.pool import PagePool
from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.memory import PAGE_TOKENS, CacheLayout
from quantmla.quant import PACKABLE_BITS, SCALE_FLOOR, Quantized, dequantize, pack, quantize, unpack

try:  # the fused kernels need Triton (a GPU, or TRITON_INTERPRET=1 on CPU)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    triton = None


@dataclass(frozen=True)
class Path:
    """One cached path (content latent or RoPE key) in a layout."""

    name: str  # "content" | "rope"
    dim: int
    bits: int
    meta_dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.dim * self.bits // 8


def paths(layout: CacheLayout) -> tuple[Path, Path]:
    s = layout.spec
    return (
        Path("content", layout.d_c, s.content_bits, getattr(torch, s.content_meta_dtype)),
        Path("rope", layout.d_r, s.rope_bits, getattr(torch, s.rope_meta_dtype)),
    )


def check_packable(layout: CacheLayout) -> None:
    """One line for a layout the packed cache cannot hold."""
    s = layout.spec
    for path in paths(layout):
        if path.bits not in PACKABLE_BITS:
            raise ConfigError(
                f"{path.name} bits (precision {s.precision})",
                path.bits,
                f"{PACKABLE_BITS} for the packed cache (16-bit paths: cache.backend=simulator)",
            )
        if path.dim % s.group_size:
            raise ConfigError(
                "group_size", s.group_size, f"a divisor of {path.name} dim {path.dim}"
            )


def token_bytes(layout: CacheLayout, c: torch.Tensor, k_r: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reference: each section's bytes per token, (n, bytes) uint8, from the one quantizer."""
    out = {}
    for path, x in zip(paths(layout), (c, k_r)):
        q = quantize(x.float(), path.bits, layout.spec.group_size, path.meta_dtype)
        out[f"{path.name}_codes"] = pack(q.codes.flatten(-2), path.bits)
        out[f"{path.name}_scales"] = q.scale.flatten(-2).contiguous().view(torch.uint8)
        out[f"{path.name}_zeros"] = q.zero.flatten(-2).to(torch.uint8)
    return out


def read_tokens(pool: PagePool, request_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference reader: every token of a request dequantized from its pages, (T, d_c), (T, d_r)
    float32 — what the simulator's quantize-dequantize gives for the same rows."""
    layout, request = pool.layout, pool.request(request_id)
    pos = torch.arange(request.tokens)
    pages = request.page_table()[pos // PAGE_TOKENS].to(pool.device)
    slots = (pos % PAGE_TOKENS).to(pool.device)
    flat, page_bytes, g = pool.storage.view(-1), layout.page_bytes(), layout.spec.group_size
    out = []
    for path in paths(layout):
        groups = path.dim // g
        fields = {}
        for kind, row in (
            ("codes", path.row_bytes),
            ("scales", groups * path.meta_dtype.itemsize),
            ("zeros", groups),
        ):
            start, _ = layout.sections()[f"{path.name}_{kind}"]
            index = (pages * page_bytes + start + slots * row)[:, None] + torch.arange(
                row, device=pool.device
            )
            fields[kind] = flat[index]
        q = Quantized(
            unpack(fields["codes"], path.bits).reshape(-1, groups, g),
            fields["scales"].contiguous().view(path.meta_dtype).reshape(-1, groups, 1),
            fields["zeros"].reshape(-1, groups, 1).to(path.meta_dtype),
            path.bits,
        )
        out.append(dequantize(q))
    return out[0], out[1]


def _destinations(pool: PagePool, request_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(physical page, slot) of the request's last `n` tokens."""
    request = pool.request(request_id)
    pos = torch.arange(request.tokens - n, request.tokens)
    table = request.page_table()
    return table[pos // PAGE_TOKENS].to(pool.device), (pos % PAGE_TOKENS).to(pool.device)


def _write_reference(pool: PagePool, pages, slots, c, k_r) -> None:
    flat = pool.storage.view(-1)
    page_bytes = pool.layout.page_bytes()
    for name, data in token_bytes(pool.layout, c, k_r).items():
        start, _ = pool.layout.sections()[name]
        row = data.shape[-1]
        base = pages * page_bytes + start + slots * row  # int64
        index = base[:, None] + torch.arange(row, device=pool.device)[None, :]
        flat[index.flatten()] = data.flatten().to(pool.device)


def _write_protection(pool: PagePool, request_id: int, c, k_r) -> None:
    """First `sink` tokens at their position; others in the ring slot sink + pos % recent."""
    layout, request = pool.layout, pool.request(request_id)
    if not layout.quantized:
        return
    n = c.shape[0]
    pos = torch.arange(request.tokens - n, request.tokens)
    rows = torch.cat([c, k_r], dim=-1).to(request.protection.dtype)
    keep = (pos < layout.sink) | (pos >= request.tokens - layout.recent)
    slot = torch.where(pos < layout.sink, pos, layout.sink + pos % max(layout.recent, 1))
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
    n = c.shape[0]
    pool.reserve(request_id, n)  # raises before anything is written
    pages, slots = _destinations(pool, request_id, n)
    if backend == "torch":
        _write_reference(pool, pages, slots, c, k_r)
    elif backend == "triton":
        _write_triton(pool, pages, slots, c, k_r)
    else:
        raise ConfigError("writer backend", backend, ("torch", "triton"))
    _write_protection(pool, request_id, c, k_r)


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
        META_BYTES: tl.constexpr,
        CODES_AT: tl.constexpr,
        SCALES_AT: tl.constexpr,
        ZEROS_AT: tl.constexpr,
    ):
        PER_BYTE: tl.constexpr = 8 // BITS
        GROUP_BYTES: tl.constexpr = GROUP // PER_BYTE
        GROUPS: tl.constexpr = DIM // GROUP
        LEVELS: tl.constexpr = (1 << BITS) - 1
        g = tl.arange(0, GROUPS)
        b = tl.arange(0, GROUP_BYTES)
        j = tl.arange(0, PER_BYTE)
        index = g[:, None, None] * GROUP + b[None, :, None] * PER_BYTE + j[None, None, :]
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
        packed = tl.sum(codes << (j[None, None, :] * BITS), axis=2)  # (GROUPS, GROUP_BYTES)
        row = page_base + slot * (DIM * BITS // 8)
        offs = g[:, None] * GROUP_BYTES + b[None, :]
        tl.store(out_ptr + row + CODES_AT + offs, packed.to(tl.uint8))
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
        C_META: tl.constexpr,
        C_CODES: tl.constexpr,
        C_SCALES: tl.constexpr,
        C_ZEROS: tl.constexpr,
        D_R: tl.constexpr,
        R_BITS: tl.constexpr,
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
            R_META,
            R_CODES,
            R_SCALES,
            R_ZEROS,
        )


def layout_constants(layout: CacheLayout) -> dict:
    """The kernels' compile-time description of a layout: dims, bits, metadata bytes and each
    section's byte offset inside a page."""
    check_packable(layout)
    content, rope = paths(layout)
    if torch.float16 in (content.meta_dtype, rope.meta_dtype):
        raise ConfigError("metadata dtype (Triton kernels)", "float16", ("bfloat16", "float32"))
    sec = layout.sections()
    out = {"D_C": layout.d_c, "D_R": layout.d_r, "GROUP": layout.spec.group_size}
    out["PAGE_BYTES"] = layout.page_bytes()
    for prefix, path in (("C", content), ("R", rope)):
        out[f"{prefix}_BITS"] = path.bits
        out[f"{prefix}_META"] = path.meta_dtype.itemsize
        for kind in ("codes", "scales", "zeros"):
            out[f"{prefix}_{kind.upper()}"] = sec[f"{path.name}_{kind}"][0]
    return out


def _write_triton(pool: PagePool, pages, slots, c, k_r) -> None:
    if triton is None:  # pragma: no cover
        raise RuntimeError("backend=triton needs the triton package")
    _writer_kernel[(c.shape[0],)](
        c.float().contiguous(),
        k_r.float().contiguous(),
        pages.contiguous(),
        slots.contiguous(),
        pool.storage,
        **layout_constants(pool.layout),
    )
