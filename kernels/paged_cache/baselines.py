"""Benchmark-only baselines over the same pages (Fig. 5b): dequantize every page into a BF16
workspace, and the decode kernel run over a BF16 paged cache (every token unquantized)."""

from __future__ import annotations

import torch

from quantmla_kernels.paged_cache.decode import launch_decode
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
