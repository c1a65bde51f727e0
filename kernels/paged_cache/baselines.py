"""Benchmark-only baselines over the same pages (Fig. 5b): dequantize every page into a BF16
workspace, and the decode kernel run over a BF16 paged cache (every token unquantized)."""

from __future__ import annotations

import torch

from quantmla_kernels.paged_cache.decode import _dequant_tile, launch_decode
from quantmla_kernels.paged_cache.layout import layout_constants
from quantmla_kernels.paged_cache.pool import PagePool

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _dequant_pages_kernel(
        store_ptr,
        out_ptr,
        D_C: tl.constexpr,
        D_R: tl.constexpr,
        GROUP: tl.constexpr,
        PAGE_BYTES: tl.constexpr,
        C_BITS: tl.constexpr,
        C_WORD: tl.constexpr,
        C_META: tl.constexpr,
        C_CODES: tl.constexpr,
        C_SCALES: tl.constexpr,
        C_ZEROS: tl.constexpr,
        R_BITS: tl.constexpr,
        R_WORD: tl.constexpr,
        R_META: tl.constexpr,
        R_CODES: tl.constexpr,
        R_SCALES: tl.constexpr,
        R_ZEROS: tl.constexpr,
        PAGE: tl.constexpr,
    ):
        """Baseline: one packed page → BF16 rows [ĉ | k̂_R] of a workspace."""
        page = tl.program_id(0).to(tl.int64)
        base = page * PAGE_BYTES
        rows = tl.arange(0, PAGE)
        c = _dequant_tile(store_ptr, base, rows, D_C, GROUP, C_BITS, C_WORD, C_META,
                          C_CODES, C_SCALES, C_ZEROS, PAGE)  # fmt: skip
        k = _dequant_tile(store_ptr, base, rows, D_R, GROUP, R_BITS, R_WORD, R_META,
                          R_CODES, R_SCALES, R_ZEROS, PAGE)  # fmt: skip
        row_at = (page * PAGE + rows[:, None]) * (D_C + D_R)
        tl.store(out_ptr + row_at + tl.arange(0, D_C)[None, :], c.to(out_ptr.dtype.element_ty))
        tl.store(
            out_ptr + row_at + D_C + tl.arange(0, D_R)[None, :], k.to(out_ptr.dtype.element_ty)
        )


def dequantize_pages(
    pool: PagePool, dtype=torch.bfloat16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every physical page dequantized into a (n_pages, page tokens, d_c + d_r) workspace
    (baseline); `out` reuses a preallocated one."""
    layout = pool.layout
    if out is None:
        out = torch.empty(
            pool.n_pages,
            layout.page_tokens,
            layout.d_c + layout.d_r,
            dtype=dtype,
            device=pool.device,
        )
    _dequant_pages_kernel[(pool.n_pages,)](
        pool.storage, out, **layout_constants(layout), PAGE=layout.page_tokens
    )
    return out


def decode_bf16_pages(
    pages,
    table,
    lens,
    layout,
    q_lat,
    q_rope,
    scaling,
    num_splits=None,
    block_h=None,
    dot_dtype=None,
):
    """The same kernel over a BF16 paged cache (n_pages, page tokens, d_c + d_r): every token unquantized,
    no protection split: the BF16 baseline of the latency sweep."""
    storage = torch.empty(1, dtype=torch.uint8, device=pages.device)
    return launch_decode(
        q_lat=q_lat,
        q_rope=q_rope,
        scaling=scaling,
        table=table,
        lens=lens,
        layout=layout,
        storage=storage,
        bf16_pages=pages,
        num_splits=num_splits,
        block_h=block_h,
        dot_dtype=dot_dtype,
    )
