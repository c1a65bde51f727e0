"""Dequantize a list of packed pages into a BF16 (or fp32) workspace of rows [ĉ | k̂_R]: the
context gather of a chunked prefill (vLLM's `gather_and_maybe_dequant_cache` for our pages) and
the dequantize-everything baseline of Fig. 5b. `cpu.dequantize_pages` is its torch reference."""

from __future__ import annotations

import torch

from quantmla.memory import CacheLayout
from quantmla_kernels.paged_cache.launch import launch
from quantmla_kernels.paged_cache.layout import layout_constants
from quantmla_kernels.paged_cache.tiles import DECODE_TILE, dequant_tile

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _gather_pages_kernel(
        store_ptr,
        pages_ptr,
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
        TILE: tl.constexpr,
    ):
        """Program i: packed page `pages[i]` → workspace rows i·PAGE .. (i + 1)·PAGE, TILE rows
        at a time (a whole 64-row page at d_c 512 spilled on sm_80)."""
        i = tl.program_id(0).to(tl.int64)
        base = tl.load(pages_ptr + i).to(tl.int64) * PAGE_BYTES
        for sub in range(0, PAGE, TILE):
            rows = sub + tl.arange(0, TILE)
            c = dequant_tile(store_ptr, base, rows, D_C, GROUP, C_BITS, C_WORD, C_META,
                              C_CODES, C_SCALES, C_ZEROS, TILE)  # fmt: skip
            k = dequant_tile(store_ptr, base, rows, D_R, GROUP, R_BITS, R_WORD, R_META,
                              R_CODES, R_SCALES, R_ZEROS, TILE)  # fmt: skip
            row_at = (i * PAGE + rows[:, None]) * (D_C + D_R)
            tl.store(out_ptr + row_at + tl.arange(0, D_C)[None, :], c.to(out_ptr.dtype.element_ty))
            tl.store(
                out_ptr + row_at + D_C + tl.arange(0, D_R)[None, :],
                k.to(out_ptr.dtype.element_ty),
            )


def gather_pages(
    storage: torch.Tensor, layout: CacheLayout, pages: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Pages `pages` (n,) of `storage` (n_pages, page bytes) dequantized into the first
    n · page tokens rows of `out` (rows ≥ n · page tokens, d_c + d_r); returns that view."""
    n = pages.shape[0]
    rows = n * layout.page_tokens
    if out.shape[0] < rows or out.shape[-1] != layout.d_c + layout.d_r:
        raise ValueError(
            f"workspace {tuple(out.shape)} cannot hold {n} pages of {layout.page_tokens} rows "
            f"of {layout.d_c + layout.d_r}"
        )
    if n:
        launch(
            _gather_pages_kernel, (n,),
            storage, pages.to(torch.int64).contiguous(), out,
            **layout_constants(layout), PAGE=layout.page_tokens,
            TILE=min(DECODE_TILE, layout.page_tokens),
        )  # fmt: skip
    return out[:rows]
