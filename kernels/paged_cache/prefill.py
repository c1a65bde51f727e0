"""A prefill chunk's attention passes on engine tensors (heads first: (H, rows, width)): passes by
torch's fused CPU attention or the score matrix, their LSE merge, and the pass over the exact
copies of a quantized chunk (the sinks and the band 0 ≤ i − j < recent) — the C++ op
`window_merge` (`prefill.cpp`) on a CPU where it builds, else the torch passes it is tested
against (`window_passes_torch`, float64)."""

from __future__ import annotations

from bisect import bisect_left

import torch
import torch.nn.functional as F

from quantmla_kernels.paged_cache import native

# queries per block of the torch band of exact copies (a block's score matrix reads its own keys
# and the `recent` − 1 before them), and the most scores held at once
BAND_BLOCK = 64
BAND_SCORES = 1 << 24


def merge_states(out_a, lse_a, out_b, lse_b):
    """Two softmax-attention partial results over disjoint keys → the one over their union
    (vLLM's `merge_attn_states`): outputs (…, d), log-sum-exps (…); −inf = no key read."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(finite, torch.exp(lse_a - safe), 0.0)[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - safe), 0.0)[..., None]
    return out_a * w_a + out_b * w_b, lse


def attend_scores(qh, keys, values, mask, scaling):
    """(out (H, n, d_v), lse (H, n)) of queries qh (H, n, d) over keys/values (H, m, ·) where
    `mask` (n, m) is True (None: every key); rows that read nothing get out 0, lse −inf."""
    scores = (qh @ keys.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return p @ values, lse


def attend(qh, keys, values, mask, scaling, causal: bool = False):
    """`attend_scores`, or with `causal` query r reading keys 0 .. r (as many queries as keys), by
    torch's fused CPU attention on a CPU (one pass, no score matrix, causal blocks skipped; it
    wants one head width, so the narrower of keys and values is zero-padded — zeros change no
    score and add only zero columns) and by `attend_scores` elsewhere."""
    if qh.device.type != "cpu":
        if causal:  # top-left: query r reads keys 0 .. r
            shape = (qh.shape[-2], keys.shape[-2])
            mask = torch.ones(shape, dtype=torch.bool, device=qh.device).tril()
        return attend_scores(qh, keys, values, mask, scaling)
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


def window_passes_torch(
    qh, keys, values, j: list[int], start: int, sink: int, recent: int, scaling
):
    """(first query, out, lse) of the torch passes of `merge_window`: the sinks in one fused pass,
    the band in blocks (`_band`)."""
    n, parts = qh.shape[1], []
    sinks = bisect_left(j, sink)
    if sinks:
        mask = None
        if j[sinks - 1] > start:  # a first chunk: queries before a sink do not read it
            i = start + torch.arange(n, device=qh.device)[:, None]
            mask = torch.tensor(j[:sinks], device=qh.device)[None] <= i
        parts.append((0, *attend(qh, keys[:, :sinks], values[:, :sinks], mask, scaling)))
    if recent and sinks < len(j):
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


def merge_window(qh, keys, values, j: list[int], start: int, sink: int, recent: int, scaling,
                 out, lse, native_op: bool = True) -> None:  # fmt: skip
    """Merge into `out` (H, n, d_v) / `lse` (H, n), in place, the pass of the chunk's queries
    (positions start ..) over the exact copies at sorted positions `j` (keys / values (H, m, ·)):
    the sinks (j < sink) read by every query at or after them, the band 0 ≤ i − j < recent over the
    rest (contiguous positions). The C++ op on a CPU where it builds (`native_op`), else the torch
    passes and `merge_states`."""
    sinks = bisect_left(j, sink)
    if sinks < len(j) and j[-1] - j[sinks] != len(j) - 1 - sinks:
        raise RuntimeError("the exact copies past the sinks are not contiguous positions")
    if (
        native_op
        and qh.device.type == "cpu"
        and qh.dtype in (torch.float32, torch.float64)
        and native.available()
    ):
        held = len(j) if recent else sinks  # without a band only the sinks are read
        base = j[sinks] if sinks < len(j) else start
        native.native_window_merge(
            qh, keys[:, :held], values[:, :held], j[:sinks], base, start, recent, scaling, out, lse
        )
        return
    for a, part, part_lse in window_passes_torch(qh, keys, values, j, start, sink, recent, scaling):
        b = a + part.shape[1]
        out[:, a:b], lse[:, a:b] = merge_states(out[:, a:b], lse[:, a:b], part, part_lse)
