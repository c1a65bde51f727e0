"""The backend's math on an engine's tensors (no vLLM import): write tokens through a slot
mapping, read a prefill chunk's context from the pages, decode over block tables.

A prefill chunk attends by `quantmla.attention.prefill_attention` (the simulator's rule, in fused
passes) over a `PrefillContext` whose `read` is `context_reader` (packed pages, dequantized) or
`row_reader` (BF16 mode's rows). Decode reads packed pages and the request's protection rows
through the cache's ops (`quantmla_kernels.paged_cache.ops`: Triton on CUDA, the CPU path
elsewhere); both return the softmax-weighted latent, to which the engine applies W_UV.
"""

from __future__ import annotations

import torch

from quantmla.memory import CacheLayout
from quantmla_kernels.paged_cache import ops


def page_storage(kv_cache: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
    """An engine's (blocks, block tokens, token bytes) uint8 cache as (blocks, page bytes) pages."""
    storage = kv_cache.reshape(kv_cache.shape[0], -1)
    if storage.shape[1] != layout.page_bytes() or not storage.is_contiguous():
        raise RuntimeError(
            f"the engine's KV blocks are not dense {layout.page_bytes()}-byte pages "
            f"(shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()}); use a layout that "
            "stores each block contiguously"
        )
    return storage


def write_packed(storage, layout: CacheLayout, slot_mapping, c, k_r, kernel: str) -> None:
    """Pack the new tokens at their slots (slot = block · block tokens + offset; −1 = padding)."""
    slots = slot_mapping.flatten().to(torch.int64)
    c, k_r = c[: slots.shape[0]], k_r[: slots.shape[0]]
    valid = slots >= 0
    if not bool(valid.all()):
        slots, c, k_r = slots[valid], c[valid], k_r[valid]
    if slots.numel():
        page = layout.page_tokens
        ops.write(storage, layout, slots // page, slots % page, c, k_r, kernel)


def write_rows(kv_cache, slot_mapping, c, k_r) -> None:
    """BF16 mode: each token one row [c | k_R] of the engine's row pages."""
    slots = slot_mapping.flatten().to(torch.int64)
    flat = kv_cache.view(-1, c.shape[-1] + k_r.shape[-1])
    rows = torch.cat([c[: slots.shape[0]], k_r[: slots.shape[0]]], dim=-1)
    valid = slots >= 0
    flat[slots[valid]] = rows[valid].to(flat.dtype)


def context_reader(storage, layout: CacheLayout, table_row, workspace, kernel: str):
    """`read(start, end)` of `PrefillContext` over packed pages: the pages covering positions
    [start, end) of one request (`table_row`) dequantized by `ops.dequantize` (into `workspace`,
    rows ≥ the chunk + two pages, d_c + d_r, where the op takes one)."""
    page = layout.page_tokens

    def read(start: int, end: int):
        first, last = start // page, -(-end // page)
        c, k_r = ops.dequantize(storage, layout, table_row[first:last], workspace, kernel)
        lo = start - first * page
        return c[lo : lo + end - start], k_r[lo : lo + end - start]

    return read


def row_reader(kv_cache, table_row, d_c: int):
    """`read(start, end)` over BF16 mode's row pages (blocks, block tokens, d_c + d_r)."""
    page = kv_cache.shape[1]

    def read(start: int, end: int):
        first, last = start // page, -(-end // page)
        rows = kv_cache.index_select(0, table_row[first:last].to(torch.int64))
        rows = rows.reshape(-1, kv_cache.shape[-1])[start - first * page : end - first * page]
        return rows[:, :d_c], rows[:, d_c:]

    return read


def decode_latent(q_lat, q_rope, scaling, table, lens, layout, storage, prot, slots, kernel: str):
    """(B, H, d_c) float32 softmax-weighted latent over packed pages + protection rows (request
    b's: row slots[b] of the table's buffer `prot`)."""
    return ops.decode(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, layout=layout,
        storage=storage, prot=prot, prot_slots=slots, kernel=kernel,
    )[0]  # fmt: skip


def decode_latent_rows(q_lat, q_rope, scaling, table, lens, kv_cache, d_c: int, kernel: str):
    """BF16 mode: the same over the engine's row pages (every token unquantized)."""
    return ops.decode_rows(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, pages=kv_cache,
        d_c=d_c, kernel=kernel,
    )[0]  # fmt: skip
