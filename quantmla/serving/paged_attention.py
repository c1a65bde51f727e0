"""The backend's math on an engine's tensors (no vLLM import): write tokens through a slot
mapping, prefill with a quantized history, decode over block tables.

Prefill attends as the simulator does (docs/simulator.md): query i reads token j unquantized iff
j < sink or i − j < recent, the dequantized copy otherwise. A prefill chunk (vLLM's chunked
prefill: any chunk size, any boundary) attends over its own tokens (both copies expanded through
`kv_b_proj`), the context's BF16 protection rows and the context's dequantized pages, read in
workspace-sized chunks; each part under the rule's mask, LSE-merged (`merge_states`), blocks of
queries gathering only the keys one of them reads. Decode reads packed pages and the request's
protection rows through the cache's ops (`quantmla_kernels.paged_cache.ops`: Triton on CUDA, the
CPU path elsewhere); both return the softmax-weighted latent, to which the engine applies W_UV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantmla.memory import CacheLayout
from quantmla.quant import qdq_content, qdq_rope
from quantmla_kernels.paged_cache import ops

# queries per score block in prefill: quantized, a block reads both copies of as many keys as it
# has queries (small blocks); BF16 mode reads one copy (larger blocks: fewer key copies)
PREFILL_BLOCK = {True: 128, False: 512}


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
    at most `chunk` tokens at a time (the bounded workspace)."""

    tokens: int
    positions: torch.Tensor
    exact: torch.Tensor
    read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    chunk: int


def merge_states(out_a, lse_a, out_b, lse_b):
    """Two softmax-attention partial results over disjoint keys → the one over their union
    (vLLM's `merge_attn_states`): outputs (…, d), log-sum-exps (…); −inf = no key read."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(finite, torch.exp(lse_a - safe), 0.0)[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - safe), 0.0)[..., None]
    return out_a * w_a + out_b * w_b, lse


def _attend(qh, keys, values, mask, scaling):
    """(out (H, n, d_v), lse (H, n)) of queries qh (H, n, d) over keys/values (H, m, ·) where
    `mask` (n, m) is True; rows that read nothing get out 0, lse −inf."""
    scores = (qh @ keys.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ values, lse


def prefill_attention(
    q, c, k_r, kv_b_proj, spec, sink, recent, d_nope, d_v, scaling, context=None
):  # fmt: skip
    """(n, H · d_v) attention output of one request's prefill chunk: its n new tokens at positions
    t₀ .. t₀ + n − 1 (t₀ = `context.tokens`, 0 without one) over themselves and the context.

    q (n, H, d_nope + d_r), c (n, d_c), k_r (n, d_r); `kv_b_proj(x)` → (n, H · (d_nope + d_v)).
    Keys come in parts — the new tokens exact and dequantized, the context's exact rows, the
    context's cache copy — each read under the rule's mask. A context that fits one workspace
    read is attended with the rest in one softmax; a longer one in workspace-sized reads whose
    partial results are LSE-merged."""
    n, heads = q.shape[0], q.shape[1]
    start = context.tokens if context is not None else 0
    work = torch.promote_types(q.dtype, torch.float32)

    def expand(latent, rope):
        m = latent.shape[0]
        kv = kv_b_proj(latent.to(c.dtype)).view(m, heads, d_nope + d_v).to(work)
        k_nope, v = kv.split([d_nope, d_v], dim=-1)
        k = torch.cat([k_nope, rope[:, None, :].expand(m, heads, -1).to(work)], dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)  # (H, m, ·)

    # (positions, keys, values, exact copy?) of every part; a query i reads key j iff j ≤ i and,
    # when quantized, the copy is the rule's: exact iff j < sink or i − j < recent
    positions = start + torch.arange(n, device=q.device)
    parts = [(positions, *expand(c, k_r), True)]
    if spec.quantized:  # the dequantized copies some query reads: positions ≥ sink, ≤ last − recent
        lo, hi = min(max(0, sink - start), n), max(0, n - recent)
        if lo < hi:
            dq = qdq_content(spec, c[lo:hi]), qdq_rope(spec, k_r[lo:hi])
            parts.append((positions[lo:hi], *expand(*dq), False))
    reads = []  # the context's cache copy, (start, end) per workspace read
    if context is not None and context.tokens:
        if spec.quantized and context.positions.numel():
            rows = context.exact.to(work)
            latent, rope = rows[:, : c.shape[1]], rows[:, c.shape[1] :]
            parts.append((context.positions.to(q.device), *expand(latent, rope), True))
        # read only where the rule does: all of it in BF16 mode, else positions ≥ sink at least
        # `recent` before the chunk's last query
        lo = min(sink, context.tokens) if spec.quantized else 0
        hi = min(context.tokens, start + n - recent) if spec.quantized else context.tokens
        reads = [(a, min(hi, a + context.chunk)) for a in range(lo, hi, context.chunk)]

    def cached(a, b):
        return (torch.arange(a, b, device=q.device), *expand(*context.read(a, b)),
                not spec.quantized)  # fmt: skip

    qh = q.transpose(0, 1).to(work)
    if len(reads) <= 1:  # one softmax over every part
        parts += [cached(*reads[0])] if reads else []
        out = torch.empty(heads, n, d_v, dtype=work, device=q.device)
        for a, b, keys, values, mask in _blocks(positions, parts, spec, sink, recent):
            out[:, a:b] = F.scaled_dot_product_attention(
                qh[:, a:b], keys, values, attn_mask=mask, scale=scaling
            )
        return out.transpose(0, 1).reshape(n, heads * d_v)
    out = torch.zeros(heads, n, d_v, dtype=work, device=q.device)
    lse = torch.full((heads, n), float("-inf"), dtype=work, device=q.device)
    for group in [parts] + [[cached(a, b)] for a, b in reads]:
        for a, b, keys, values, mask in _blocks(positions, group, spec, sink, recent):
            part, part_lse = _attend(qh[:, a:b], keys, values, mask, scaling)
            out[:, a:b], lse[:, a:b] = merge_states(out[:, a:b], lse[:, a:b], part, part_lse)
    return out.transpose(0, 1).reshape(n, heads * d_v)


def _spans(jj, first: int, last: int, exact: bool, spec, sink: int, recent: int):
    """Index ranges of a part's sorted key positions `jj` that some query at positions
    first .. last reads: j ≤ last and, quantized, the rule's copy (exact: j < sink or
    j > first − recent; dequantized: sink ≤ j ≤ last − recent)."""

    def upto(p):  # how many positions ≤ p
        return int(torch.searchsorted(jj, torch.tensor([p], device=jj.device), right=True))

    end = upto(last)
    if not spec.quantized:
        return [(0, end)]
    if not exact:
        return [(upto(sink - 1), upto(last - recent))]
    sinks = upto(min(sink, last + 1) - 1)
    return [(0, sinks), (max(sinks, upto(first - recent)), end)]


def _reads(i, j, exact: bool, spec, sink: int, recent: int):
    """Whether query position(s) i read key position(s) j in this copy (the rule; broadcasts)."""
    mask = j <= i
    if spec.quantized:
        mask = mask & (((j < sink) | (i - j < recent)) == exact)
    return mask


def _blocks(positions, parts, spec, sink, recent):
    """Per block of `PREFILL_BLOCK[quantized]` queries: (a, b, keys, values, mask) with only the
    keys some query of the block reads, from every part, concatenated (a part's keys are found by
    their positions' ranges, so a block reads both copies of at most as many keys as it has
    queries). The queries that read a key form an interval of positions, so a key every query of
    the block reads is found from the block's first and last query; the mask is computed only
    for the other keys (the band near the diagonal)."""
    size = PREFILL_BLOCK[spec.quantized]
    for a in range(0, positions.shape[0], size):
        b = min(positions.shape[0], a + size)
        i = positions[a:b, None]
        first, last = int(positions[a]), int(positions[b - 1])
        pieces, width = [], 0
        for jj, keys, values, exact in parts:
            for lo, hi in _spans(jj, first, last, exact, spec, sink, recent):
                if lo >= hi:
                    continue
                j = jj[lo:hi]
                full = _reads(first, j, exact, spec, sink, recent)
                full &= _reads(last, j, exact, spec, sink, recent)
                banded = (~full).nonzero().squeeze(1)
                pieces.append((keys[:, lo:hi], values[:, lo:hi], width, j[banded], banded, exact))
                width += hi - lo
        if not pieces:
            continue
        mask = torch.ones(b - a, width, dtype=torch.bool, device=positions.device)
        for _, _, offset, j, banded, exact in pieces:
            if banded.numel():
                mask[:, offset + banded] = _reads(i, j[None, :], exact, spec, sink, recent)
        keys = torch.cat([p[0] for p in pieces], dim=-2)
        values = torch.cat([p[1] for p in pieces], dim=-2)
        yield a, b, keys, values, mask


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


def decode_latent(q_lat, q_rope, scaling, table, lens, layout, storage, prot, kernel: str):
    """(B, H, d_c) float32 softmax-weighted latent over packed pages + protection rows."""
    return ops.decode(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, layout=layout,
        storage=storage, prot=prot, kernel=kernel,
    )[0]  # fmt: skip


def decode_latent_rows(q_lat, q_rope, scaling, table, lens, kv_cache, d_c: int, kernel: str):
    """BF16 mode: the same over the engine's row pages (every token unquantized)."""
    return ops.decode_rows(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, pages=kv_cache,
        d_c=d_c, kernel=kernel,
    )[0]  # fmt: skip
