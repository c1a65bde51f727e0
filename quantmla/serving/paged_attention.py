"""The backend's math on an engine's tensors (no vLLM import): write tokens through a slot
mapping, prefill with a quantized history, decode over block tables.

Prefill attends as the simulator does (docs/simulator.md): query i reads token j unquantized iff
j < sink or i − j < recent, the dequantized copy otherwise. A prefill chunk (vLLM's chunked
prefill: any chunk size, any boundary) attends over its own tokens (both copies expanded through
`kv_b_proj`), the context's BF16 protection rows and the context's dequantized pages, read in
workspace-sized chunks: the context every query of the chunk reads without a mask, the
dequantized copies read under the causal rule shifted by `recent` (both by torch's fused CPU
attention on a CPU), LSE-merged, then the exact copies as the sinks and a band
(`quantmla_kernels.paged_cache.prefill`: one C++ op on a CPU). Decode reads
packed pages and the request's protection rows through the cache's ops
(`quantmla_kernels.paged_cache.ops`: Triton on CUDA, the CPU path elsewhere); both return the
softmax-weighted latent, to which the engine applies W_UV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantmla.memory import CacheLayout
from quantmla.quant import qdq_content, qdq_rope
from quantmla_kernels.paged_cache import ops
from quantmla_kernels.paged_cache.prefill import attend, merge_states, merge_window


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


@dataclass
class PrefillContext:
    """A prefill chunk's earlier tokens: `tokens` of them, the BF16 `exact` rows held for some
    (`positions`, rows (m, d_c + d_r); the protection rows), and `read(start, end)` giving the
    cache's copy of positions [start, end) — dequantized packed pages, or BF16 mode's own rows —
    at most `chunk` tokens at a time (the bounded workspace). `written`: the cache holds the
    chunk's own tokens too (vLLM writes a step's tokens before attending), so their dequantized
    copies are read from it, not quantized again."""

    tokens: int
    positions: torch.Tensor
    exact: torch.Tensor
    read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    chunk: int
    written: bool = False


def prefill_attention(
    q, c, k_r, kv_b_proj, spec, sink, recent, d_nope, d_v, scaling, context=None
):  # fmt: skip
    """(n, H · d_v) attention output of one request's prefill chunk: its n new tokens at positions
    t₀ .. t₀ + n − 1 (t₀ = `context.tokens`, 0 without one) over themselves and the context.

    q (n, H, d_nope + d_r), c (n, d_c), k_r (n, d_r); `kv_b_proj(x)` → (n, H · (d_nope + d_v)).
    Three kinds of keys, each in fused passes (`attend`), LSE-merged:
    - the *bulk*: the context's cache copy every query of the chunk reads (all of it in BF16
      mode; positions sink .. t₀ − recent when quantized), without a mask, in workspace reads;
    - the *causal* run: the copy read by query i up to position i − recent (recent = 0 in BF16
      mode: the new tokens themselves; quantized: the dequantized copies of positions t₀ − recent
      + 1 .. t₀ + n − 1 − recent ≥ sink, the context's and the chunk's), contiguous, so query
      p₀ + recent + r reads its first r + 1 keys: square causal attention;
    - quantized, the *window*: the exact copies (the context's protection rows, the new tokens):
      the sinks and the band i − j < recent, merged in place last (`merge_window`: one C++ op on a
      CPU)."""
    n, heads = q.shape[0], q.shape[1]
    start = context.tokens if context is not None else 0
    work = torch.promote_types(q.dtype, torch.float32)
    quantized = spec.quantized

    def expand(latent, rope):
        m = latent.shape[0]
        kv = kv_b_proj(latent.to(c.dtype)).view(m, heads, d_nope + d_v).to(work)
        k_nope, v = kv.split([d_nope, d_v], dim=-1)
        k = torch.cat([k_nope, rope[:, None, :].expand(m, heads, -1).to(work)], dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)  # (H, m, ·)

    def expand_all(parts):  # one expansion of every (latent, rope, …) part, in order
        return expand(torch.cat([p[0].to(c.dtype) for p in parts]),
                      torch.cat([p[1].to(work) for p in parts]))  # fmt: skip

    qh = q.transpose(0, 1).to(work)
    parts = []  # (first query, out, lse) of each attention pass
    run = []  # (latent, rope) of the causal run, in position order
    window = []  # (latent, rope, positions) of the exact copies (quantized)
    written = quantized and context is not None and context.written
    if context is not None and (context.tokens or written):
        tokens = context.tokens
        if quantized and context.positions.numel():
            rows = context.exact
            window.append((rows[:, : c.shape[1]], rows[:, c.shape[1] :], context.positions))
        # the cache copy is read where the rule does: all of it in BF16 mode, else positions ≥
        # sink at least `recent` before the chunk's last query (the chunk's too, when written);
        # every query reads [lo, full)
        lo, hi, full = 0, tokens, tokens
        if quantized:
            held = tokens + n if written else tokens
            lo, hi = min(sink, held), min(held, start + n - recent)
            full = min(hi, max(lo, tokens - recent + 1))
        for a in range(lo, hi, context.chunk):
            b = min(hi, a + context.chunk)
            latent, rope = context.read(a, b)
            if a < full:
                keys, values = expand(latent[: full - a], rope[: full - a])
                parts.append((0, *attend(qh, keys, values, None, scaling)))
            if b > full:  # the cache's part of the causal run
                skip = max(0, full - a)
                run.append((latent[skip:].clone(), rope[skip:].clone()))
    run_start = full if run else None
    if not quantized:
        run.append((c, k_r))
        run_start = start
    else:
        window.append((c, k_r, start + torch.arange(n, device=q.device)))
        lo, hi = min(max(0, sink - start), n), max(0, n - recent)
        if lo < hi and not written:  # the chunk's dequantized copies some query reads
            run.append((qdq_content(spec, c[lo:hi]), qdq_rope(spec, k_r[lo:hi])))
            run_start = start + lo if run_start is None else run_start
    if run:
        keys, values = expand_all(run)
        first = run_start + (recent if quantized else 0) - start  # the query reading key 0
        parts.append((first, *attend(qh[:, first:], keys, values, None, scaling, causal=True)))
    out = torch.zeros(heads, n, d_v, dtype=work, device=q.device)
    lse = torch.full((heads, n), float("-inf"), dtype=work, device=q.device)
    for a, part, part_lse in parts:
        b = a + part.shape[1]
        out[:, a:b], lse[:, a:b] = merge_states(out[:, a:b], lse[:, a:b], part, part_lse)
    if window:
        keys, values = expand_all(window)
        j = torch.cat([p[2] for p in window]).tolist()
        merge_window(qh, keys, values, j, start, sink, recent, scaling, out, lse)
    return out.transpose(0, 1).reshape(n, heads * d_v)


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
