"""The backend's math on an engine's tensors (no vLLM import): write tokens through a slot
mapping, prefill with a quantized history, decode over block tables.

Prefill attends as the simulator does (docs/simulator.md): query i reads token j unquantized iff
j < sink or i − j < recent, the dequantized copy otherwise. A prefill chunk (vLLM's chunked
prefill: any chunk size, any boundary) attends over its own tokens (both copies expanded through
`kv_b_proj`), the context's BF16 protection rows and the context's dequantized pages, read in
workspace-sized chunks: the context every query of the chunk reads without a mask, the
dequantized copies read under the causal rule shifted by `recent`, the exact copies as the sinks
and a band, LSE-merged (`merge_states`), by torch's fused CPU attention on a CPU. Decode reads
packed pages and the request's protection rows through the cache's ops
(`quantmla_kernels.paged_cache.ops`: Triton on CUDA, the CPU path elsewhere); both return the
softmax-weighted latent, to which the engine applies W_UV.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quantmla.memory import CacheLayout
from quantmla.quant import qdq_content, qdq_rope
from quantmla_kernels.paged_cache import ops

# queries per block of the quantized prefill's band of exact copies (a block's score matrix reads
# its own keys and the `recent` − 1 before them), and the most scores held at once
BAND_BLOCK = 64
BAND_SCORES = 1 << 24


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
    `mask` (n, m) is True (None: every key); rows that read nothing get out 0, lse −inf."""
    scores = (qh @ keys.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ values, lse


def attend(qh, keys, values, mask, scaling, causal: bool = False):
    """`_attend`, or with `causal` query r reading keys 0 .. r (as many queries as keys), by
    torch's fused CPU attention on a CPU (one pass, no score matrix, causal blocks skipped; it
    wants one head width, so the narrower of keys and values is zero-padded — zeros change no
    score and add only zero columns) and by `_attend` elsewhere."""
    if qh.device.type != "cpu":
        if causal:  # top-left: query r reads keys 0 .. r
            shape = (qh.shape[-2], keys.shape[-2])
            mask = torch.ones(shape, dtype=torch.bool, device=qh.device).tril()
        return _attend(qh, keys, values, mask, scaling)
    width, d_v = max(keys.shape[-1], values.shape[-1]), values.shape[-1]

    def padded(t):
        return F.pad(t, (0, width - t.shape[-1]))[None] if t.shape[-1] < width else t[None]

    bias = None
    if mask is not None and not causal:
        bias = torch.zeros(mask.shape, dtype=qh.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        padded(qh), padded(keys), padded(values), 0.0, causal, attn_mask=bias, scale=scaling
    )[:2]
    out, lse = out[0, ..., :d_v], lse[0]
    if bias is not None:  # the fused op leaves a row that reads nothing at lse 0
        empty = ~mask.any(dim=-1)
        out, lse = out.masked_fill(empty[:, None], 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


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
      the sinks in one pass, the band i − j < recent in one batched score matrix per head
      (`_window_passes`, `_band`)."""
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
    if window:
        keys, values = expand_all(window)
        j = torch.cat([p[2] for p in window]).tolist()
        parts += _window_passes(qh, keys, values, j, start, sink, recent, scaling)
    out = torch.zeros(heads, n, d_v, dtype=work, device=q.device)
    lse = torch.full((heads, n), float("-inf"), dtype=work, device=q.device)
    for a, part, part_lse in parts:
        b = a + part.shape[1]
        out[:, a:b], lse[:, a:b] = merge_states(out[:, a:b], lse[:, a:b], part, part_lse)
    return out.transpose(0, 1).reshape(n, heads * d_v)


def _window_passes(qh, keys, values, j: list[int], start: int, sink: int, recent: int, scaling):
    """(first query, out, lse) of the passes of the chunk's queries (positions start ..) over the
    exact copies at sorted positions `j`: the sinks, read by every query at or after them, and the
    band 0 ≤ i − j < recent over the rest (contiguous positions; `_band`)."""
    n, parts = qh.shape[1], []
    sinks = bisect_left(j, sink)
    if sinks:
        mask = None
        if j[sinks - 1] > start:  # a first chunk: queries before a sink do not read it
            i = start + torch.arange(n, device=qh.device)[:, None]
            mask = torch.tensor(j[:sinks], device=qh.device)[None] <= i
        parts.append((0, *attend(qh, keys[:, :sinks], values[:, :sinks], mask, scaling)))
    if recent and sinks < len(j):
        if j[-1] - j[sinks] != len(j) - 1 - sinks:
            raise RuntimeError("the exact copies past the sinks are not contiguous positions")
        parts.append(
            (0, *_band(qh, keys[:, sinks:], values[:, sinks:], j[sinks], start, recent, scaling))
        )
    return parts


def _band(qh, keys, values, base: int, start: int, recent: int, scaling):
    """(out, lse) of queries at positions start + r over keys at contiguous positions base + t
    (the last one start + n − 1) where 0 ≤ i − j < recent: queries in blocks of B = `BAND_BLOCK`,
    block b against the B + recent − 1 keys up to its last query — per head, batched over blocks,
    as overlapping strided windows of the position-major keys (a zero-padded copy only for the
    blocks at the edges), under one relative band mask (−inf where no key is held)."""
    heads, n, width = qh.shape
    block = min(BAND_BLOCK, recent)
    blocks, span = -(-n // block), block + recent - 1
    first = start - recent + 1  # the position of padded row 0 (block b's window: rows bB ..)
    skip, front = max(0, first - base), max(0, base - first)
    keys, values = (t.transpose(0, 1)[skip:].contiguous() for t in (keys, values))  # (rows, H, ·)
    held = keys.shape[0]  # real rows: padded rows front .. front + held − 1

    def rows(t, lo, hi):  # padded rows [lo, hi) of t: a view inside, else a zero-padded copy
        if front <= lo and hi <= front + held:
            return t[lo - front : hi - front]
        out = t.new_zeros(hi - lo, *t.shape[1:])
        a, b = max(lo, front), min(hi, front + held)
        out[a - lo : b - lo] = t[a - front : b - front]
        return out

    def windows(t, h, count):  # (count, span, ·): the windows of `count` blocks of head h in t
        return t.as_strided((count, span, t.shape[-1]), (block * t.stride(0), t.stride(0), 1),
                            t.storage_offset() + h * t.stride(1))  # fmt: skip

    r = torch.arange(block, device=qh.device)[:, None]
    u = torch.arange(span, device=qh.device)[None]
    bias = torch.zeros(block, span, dtype=qh.dtype, device=qh.device)
    bias.masked_fill_((u < r) | (u >= r + recent), float("-inf"))  # key u of a block's row r
    out = torch.empty(heads, blocks * block, values.shape[-1], dtype=qh.dtype, device=qh.device)
    lse = torch.empty(heads, blocks * block, dtype=qh.dtype, device=qh.device)
    inner = (-(-front // block), max(0, (front + held - span) // block + 1))  # view-only blocks
    step = max(1, BAND_SCORES // (block * span))  # blocks per score matrix
    edges = sorted({0, blocks, *(min(max(e, 0), blocks) for e in inner)})
    groups = [(a, min(b, a + step)) for lo, b in zip(edges, edges[1:]) for a in range(lo, b, step)]
    for a, b in groups:
        k, v = (rows(t, a * block, (b - 1) * block + span) for t in (keys, values))
        bias_ab = bias
        if a * block < front:  # rows before base hold no key
            missing = (
                a * block + block * torch.arange(b - a, device=qh.device)[:, None, None] + u
            ) < front
            bias_ab = bias.masked_fill(missing, float("-inf"))
        read = torch.isfinite(bias_ab).to(qh.dtype)
        for h in range(heads):
            queries = qh[h, a * block : b * block]
            if queries.shape[0] < (b - a) * block:
                queries = F.pad(queries, (0, 0, 0, (b - a) * block - queries.shape[0]))
            queries = queries.reshape(b - a, block, width)
            scores = torch.baddbmm(
                bias_ab, queries, windows(k, h, b - a).transpose(1, 2), alpha=scaling
            )
            top = scores.amax(dim=-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, 0.0)
            # exp of −inf or underflowing arguments takes a slow path on a CPU (~15–40x): clamp
            # to −80 (exp −80 ≈ 1.8e-35, a normal float; below float64's epsilon against the row
            # maximum's 1), then zero the keys outside the band
            p = scores.sub_(top).clamp_min_(-80.0).exp_().mul_(read)
            total = p.sum(dim=-1)
            o = out[h, a * block : b * block].view(b - a, block, -1)
            torch.bmm(p, windows(v, h, b - a), out=o)
            o.div_(torch.where(total > 0, total, 1.0)[..., None])
            lse[h, a * block : b * block] = (total.log() + top[..., 0]).view(-1)
    return out[:, :n], lse[:, :n]


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
