"""Decode over block tables on a CPU: the CPU path of an engine's packed cache.

Same inputs and outputs as `decode.launch_decode` (page tables, lengths, flat page storage, the
stacked protection rows; `o` (B, H, d_c) float32 and its log-sum-exp), so an engine calls one or
the other by device. The C++ op of `native.py` runs one fused pass per request and run of pages —
a page's rows dequantized into a small buffer, scored against every head and folded into an
online softmax, the protection rows as one more run — and `decode_rows` is the same code over BF16
row pages (an engine's unquantized cache: a page's rows converted instead of dequantized), so the
two are timed against each other on equal terms. Where the op cannot be built, the torch paths
(`*_torch`: the pages dequantized to float32 rows, one softmax) serve. Tested against the float64
`reference.decode_reference`.
"""

from __future__ import annotations

import math

import torch

from quantmla.memory import CacheLayout
from quantmla.quant import unpack
from quantmla_kernels.paged_cache import native
from quantmla_kernels.paged_cache.layout import check_packable, paths


def _gather_pages(storage: torch.Tensor, table: torch.Tensor, n_pages: int) -> torch.Tensor:
    """(B, n_pages, page_bytes) copies of each request's first `n_pages` pages."""
    index = table[:, :n_pages].reshape(-1).to(torch.int64)
    return storage.index_select(0, index).view(table.shape[0], n_pages, storage.shape[-1])


def dequantize_rows(
    storage: torch.Tensor, layout: CacheLayout, table: torch.Tensor, n_pages: int, keep=None
) -> torch.Tensor:
    """(B, n_pages·page, d_c + d_r) float32 rows [ĉ | k̂_R] of the pages in `table`, zero where
    `keep` (B, n_pages·page) is False: the C++ op where it is built, else the torch path."""
    b, tokens = table.shape[0], n_pages * layout.page_tokens
    if storage.device.type == "cpu" and native.available():
        pages = table[:, :n_pages].reshape(-1)
        return native.native_dequantize(storage, layout, pages, keep).view(b, tokens, -1)
    rows = torch.cat(dequantize_pages_torch(storage, layout, table, n_pages), dim=-1)
    return rows if keep is None else torch.where(keep[..., None], rows, 0.0)


def dequantize_pages(storage, layout: CacheLayout, table, n_pages: int):
    """(ĉ (B, n_pages·page, d_c), k̂_R (B, n_pages·page, d_r)) float32 of the pages in `table`."""
    rows = dequantize_rows(storage, layout, table, n_pages)
    return rows[..., : layout.d_c], rows[..., layout.d_c :]


def dequantize_pages_torch(
    storage: torch.Tensor, layout: CacheLayout, table: torch.Tensor, n_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of `dequantize_pages` (every row), and the C++ op's reference."""
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


def _query(q_lat, q_rope) -> torch.Tensor:
    """(B, H, d_c + d_r) float32 [q̃ | q_R]: one product scores a whole row [c | k_R]."""
    return torch.cat([q_lat.float(), q_rope.float()], dim=-1).contiguous()


def decode_packed(
    *, q_lat, q_rope, scaling, table, lens, layout: CacheLayout, storage, prot=None, prot_slots=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, H, d_c) float32, lse (B, H)) over packed pages (all but the protected tokens) and
    the protection rows: `prot` (B, sink + recent, d_c + d_r), or with `prot_slots` (B,) a
    buffer (slots, sink + recent, d_c + d_r) whose row prot_slots[b] is request b's (an engine's
    table, read in place). The C++ op's fused pass (each page dequantized into a small buffer and
    folded into an online softmax; float32 or bfloat16 protection rows) where it is built, else
    `decode_packed_torch`."""
    if storage.device.type != "cpu" or not native.available():
        return decode_packed_torch(q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table,
                                   lens=lens, layout=layout, storage=storage, prot=prot,
                                   prot_slots=prot_slots)  # fmt: skip
    check_packable(layout)
    t = lens.to(torch.int64)
    protected = layout.quantized and prot is not None
    lo = torch.full_like(t, layout.sink) if protected else torch.zeros_like(t)
    hi = torch.maximum(lo, t - layout.recent) if protected else t
    rows, slots = torch.empty(0), torch.empty(0, dtype=torch.int64)
    if protected:
        if prot_slots is None:
            slots = torch.arange(prot.shape[0])
        else:
            slots = prot_slots.to(torch.int64)
        rows = prot if prot.dtype in (torch.float32, torch.bfloat16) else prot.float()
    return native.native_decode(storage, layout, table.to(torch.int64).contiguous(), lo.contiguous(),
                                hi.contiguous(), _query(q_lat, q_rope), rows.contiguous(),
                                slots.contiguous(), t.contiguous(), scaling)  # fmt: skip


def decode_packed_torch(
    *, q_lat, q_rope, scaling, table, lens, layout: CacheLayout, storage, prot=None, prot_slots=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_packed` in torch: the batch's pages dequantized to rows (zero outside the packed
    region, whose bytes may be stale), then the row math of `decode_rows_torch` with the
    protected rows in the same softmax."""
    check_packable(layout)
    if prot is not None and prot_slots is not None:
        prot = prot.index_select(0, prot_slots.to(prot.device))
    n_pages = max(1, math.ceil(int(lens.max()) / layout.page_tokens))
    pos = torch.arange(n_pages * layout.page_tokens, device=lens.device)[None, :]
    t = lens.to(torch.int64)[:, None]
    protected = layout.quantized and prot is not None
    keep = (pos < t) & (pos >= layout.sink) & (pos < t - layout.recent) if protected else pos < t
    rows = dequantize_rows(storage, layout, table, n_pages, keep)
    q = _query(q_lat, q_rope)
    scores = [torch.where(keep[:, None], scaling * (q @ rows.transpose(1, 2)), -torch.inf)]
    if protected:
        _, valid = _protected_positions(lens, layout.sink, layout.recent, prot.shape[1])
        prot = prot.float()
        scores.append(torch.where(valid[:, None], scaling * (q @ prot.transpose(1, 2)), -torch.inf))
    scores = torch.cat(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    tokens = keep.shape[1]
    out = p[..., :tokens] @ rows[..., : layout.d_c]
    if protected:
        out = out + p[..., tokens:] @ prot[..., : layout.d_c]
    return out, lse


def decode_rows(*, q_lat, q_rope, scaling, table, lens, pages, d_c: int):
    """The same attention over row pages (n_pages, page, d_c + d_r) of any float dtype (every
    token unquantized): the BF16 cache of an engine — the C++ op's fused pass for float32 and
    bfloat16 rows (the same code as the packed pages', a page's rows converted instead of
    dequantized), else `decode_rows_torch`."""
    if (pages.device.type != "cpu" or pages.dtype not in (torch.float32, torch.bfloat16)
            or pages.stride(-1) != 1 or not native.available()):  # fmt: skip
        return decode_rows_torch(q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table,
                                 lens=lens, pages=pages, d_c=d_c)  # fmt: skip
    t = lens.to(torch.int64).contiguous()
    q = _query(q_lat, q_rope)
    return native.native_decode_rows(pages, table.to(torch.int64).contiguous(),  # a view: no copy
                                     torch.zeros_like(t), t, q, scaling, d_c)  # fmt: skip


def decode_rows_torch(*, q_lat, q_rope, scaling, table, lens, pages, d_c: int):
    """`decode_rows` in torch. Rows stay whole: one product for the scores ([q̃ | q_R] · [c | k_R])
    and one for the weighted sum (its RoPE columns dropped after)."""
    n_pages = max(1, math.ceil(int(lens.max()) / pages.shape[1]))
    index = table[:, :n_pages].reshape(-1).to(torch.int64)
    rows = pages.index_select(0, index).view(table.shape[0], -1, pages.shape[-1]).float()
    pos = torch.arange(rows.shape[1], device=lens.device)[None, None, :]
    keep = pos < lens.to(torch.int64)[:, None, None]
    q = _query(q_lat, q_rope)
    scores = torch.where(keep, scaling * (q @ rows.transpose(1, 2)), -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return (p @ rows)[..., :d_c], lse
