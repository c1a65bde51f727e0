"""Benchmark-only baseline over the same pages (Fig. 5b): dequantize every page into a BF16
workspace (the decode kernel over a BF16 paged cache is `ops.decode_rows`)."""

from __future__ import annotations

import torch

from quantmla_kernels.paged_cache.gather import gather_pages
from quantmla_kernels.paged_cache.pool import PagePool


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
    pages = torch.arange(pool.n_pages, device=pool.device)
    gather_pages(pool.storage, layout, pages, out.view(-1, layout.d_c + layout.d_r))
    return out
