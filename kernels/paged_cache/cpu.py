"""Decode over block tables in vectorized PyTorch: the CPU path of an engine's packed cache.

Same inputs and outputs as `decode.launch_decode` (page tables, lengths, flat page storage, the
stacked protection rows; `o` (B, H, d_c) float32 and its log-sum-exp), so an engine calls one or
the other by device. Each step gathers the batch's pages once, unpacks the codes through a
shift and mask per packed word, dequantizes per group and runs one softmax over the packed region and
the protected rows together. `decode_rows` is the same attention over BF16 row pages (an engine's
unquantized cache), so the two are timed against each other on equal terms. Tested against the
float64 `reference.decode_reference`.
"""

from __future__ import annotations

import math

import torch

from quantmla.memory import CacheLayout
from quantmla.quant import pack_word, packed_words, unpack
from quantmla_kernels.paged_cache.layout import check_packable, paths


def _gather_pages(storage: torch.Tensor, table: torch.Tensor, n_pages: int) -> torch.Tensor:
    """(B, n_pages, page_bytes) copies of each request's first `n_pages` pages."""
    index = table[:, :n_pages].reshape(-1).to(torch.int64)
    return storage.index_select(0, index).view(table.shape[0], n_pages, storage.shape[-1])


def dequantize_pages(
    storage: torch.Tensor, layout: CacheLayout, table: torch.Tensor, n_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ĉ (B, n_pages·page, d_c), k̂_R (B, n_pages·page, d_r)) float32 of the pages in `table`."""
    check_packable(layout)
    pages = _gather_pages(storage, table, n_pages)
    b, t, g = table.shape[0], layout.page_tokens, layout.spec.group_size
    sections = layout.sections()
    out = []
    for path in paths(layout):
        groups = path.dim // g

        def section(kind, width, path=path):
            start, size = sections[f"{path.name}_{kind}"]
            return pages[..., start : start + size].reshape(b, n_pages * t, width)

        codes = unpack(section("codes", path.row_bytes), path.bits).float()
        meta = path.meta_dtype.itemsize
        scale = section("scales", groups * meta).contiguous().view(path.meta_dtype).float()
        zero = section("zeros", groups).float()
        codes = codes.view(b, n_pages * t, groups, g)
        out.append(((codes - zero[..., None]) * scale[..., None]).view(b, n_pages * t, path.dim))
    return out[0], out[1]


def _protected_positions(lens: torch.Tensor, sink: int, recent: int, rows: int):
    """(positions (B, rows), valid (B, rows)) of a protection buffer's rows (the kernel's rule)."""
    r = torch.arange(rows, device=lens.device)[None, :]
    last = lens.to(torch.int64)[:, None] - 1
    ring = last - ((last - (r - sink)) % max(recent, 1))
    pos = torch.where(r < sink, r.expand_as(ring), ring)
    valid = (pos >= 0) & (pos <= last) & ((r < sink) | (pos >= sink))
    return pos, valid


class _PackedPath:
    """One path of the gathered pages in the form the grouped products need, without
    dequantizing: the codes as floats (B, G, T, per_word · group words), the m-th code of every
    packed word of a group first, then the (m+1)-th, and the per-group scale and zero (B, T, G),
    scales zeroed where `keep` is False (bytes there may be stale)."""

    def __init__(self, pages, layout: CacheLayout, path, keep):
        b, n_pages, _ = pages.shape
        t, g = layout.page_tokens, layout.spec.group_size
        _, self.per_word = pack_word(path.bits)
        self.path, self.groups = path, path.dim // g
        self.group_words, tokens = g // self.per_word, n_pages * t
        sections = layout.sections()

        def section(kind, width):
            start, size = sections[f"{path.name}_{kind}"]
            return pages[..., start : start + size].reshape(b, tokens, width)

        packed = section("codes", path.row_bytes).view(b, tokens, self.groups, -1)
        words = packed_words(packed, path.bits)  # (B, T, G, group words)
        codes = torch.empty(b, self.groups, tokens, self.per_word, self.group_words)
        words, mask = words.permute(0, 2, 1, 3), (1 << path.bits) - 1
        for m in range(self.per_word):  # -> float32, straight into the grouped layout
            codes[..., m, :].copy_((words >> (m * path.bits)) & mask)
        self.codes = codes.view(b, self.groups, tokens, -1)
        scale = section("scales", self.groups * path.meta_dtype.itemsize)
        scale = scale.contiguous().view(path.meta_dtype).float()
        self.scale = torch.where(keep[..., None], scale, 0.0)
        self.zero = section("zeros", self.groups).float()

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """(B, H, T) q · x̂_t = Σ_g s_g (q_g · codes_g) − Σ_g s_g z_g Σ_{k∈g} q_k."""
        qg = q.reshape(*q.shape[:2], self.groups, self.group_words, self.per_word)
        q_codes = qg.transpose(-1, -2).reshape(*q.shape[:2], self.groups, -1)  # (B, H, G, K)
        per_group = q_codes.transpose(1, 2) @ self.codes.transpose(-1, -2)  # (B, G, H, T)
        scores = (per_group * self.scale.permute(0, 2, 1)[:, :, None, :]).sum(1)  # (B, H, T)
        q_sum = qg.sum(dim=(-1, -2))  # (B, H, G)
        return scores - q_sum @ (self.scale * self.zero).transpose(1, 2)

    def weighted_sum(self, p: torch.Tensor) -> torch.Tensor:
        """(B, H, dim) Σ_t p_t x̂_t for weights p (B, H, T)."""
        w = p[:, None] * self.scale.permute(0, 2, 1)[:, :, None, :]  # (B, G, H, T)
        u = (w @ self.codes).view(*w.shape[:3], self.per_word, self.group_words)
        wz = (w * self.zero.permute(0, 2, 1)[:, :, None, :]).sum(-1)  # (B, G, H)
        u = u - wz[..., None, None]
        out = u.transpose(-1, -2).reshape(*w.shape[:3], -1)  # (B, G, H, g) in code order
        return out.permute(0, 2, 1, 3).reshape(w.shape[0], w.shape[2], -1)


def decode_packed(
    *, q_lat, q_rope, scaling, table, lens, layout: CacheLayout, storage, prot=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, H, d_c) float32, lse (B, H)) over packed pages (all but the protected tokens) and
    the stacked protection rows `prot` (B, sink + recent, d_c + d_r).

    The codes are never dequantized: scores and the weighted sum are grouped products of the
    unpacked bytes with the query (resp. the weights), scaled per group afterwards."""
    check_packable(layout)
    n_pages = max(1, math.ceil(int(lens.max()) / layout.page_tokens))
    pages = _gather_pages(storage, table, n_pages)
    pos = torch.arange(n_pages * layout.page_tokens, device=lens.device)[None, :]
    t = lens.to(torch.int64)[:, None]
    protected = layout.quantized and prot is not None
    keep = (pos < t) & (pos >= layout.sink) & (pos < t - layout.recent) if protected else pos < t
    content, rope = (_PackedPath(pages, layout, path, keep) for path in paths(layout))
    q_lat, q_rope = q_lat.float(), q_rope.float()
    scores = [
        torch.where(
            keep[:, None], scaling * (content.scores(q_lat) + rope.scores(q_rope)), -torch.inf
        )
    ]
    if protected:
        _, valid = _protected_positions(lens, layout.sink, layout.recent, prot.shape[1])
        rows = prot.float()
        c_p, k_p = rows[..., : layout.d_c], rows[..., layout.d_c :]
        s_p = scaling * (q_lat @ c_p.transpose(1, 2) + q_rope @ k_p.transpose(1, 2))
        scores.append(torch.where(valid[:, None], s_p, -torch.inf))
    scores = torch.cat(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    tokens = keep.shape[1]
    out = content.weighted_sum(p[..., :tokens])
    if protected:
        out = out + p[..., tokens:] @ c_p
    return out, lse


def decode_rows(*, q_lat, q_rope, scaling, table, lens, pages, d_c: int):
    """The same attention over row pages (n_pages, page, d_c + d_r) of any float dtype (every
    token unquantized): the BF16 cache of an engine. Rows stay whole: one product for the scores
    ([q̃ | q_R] · [c | k_R]) and one for the weighted sum (its RoPE columns dropped after)."""
    n_pages = max(1, math.ceil(int(lens.max()) / pages.shape[1]))
    index = table[:, :n_pages].reshape(-1).to(torch.int64)
    rows = pages.index_select(0, index).view(table.shape[0], -1, pages.shape[-1]).float()
    pos = torch.arange(rows.shape[1], device=lens.device)[None, None, :]
    keep = pos < lens.to(torch.int64)[:, None, None]
    q = torch.cat([q_lat.float(), q_rope.float()], dim=-1)
    scores = torch.where(keep, scaling * (q @ rows.transpose(1, 2)), -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return (p @ rows)[..., :d_c], lse
