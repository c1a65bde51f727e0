"""Decode over block tables in vectorized PyTorch: the CPU path of an engine's packed cache.

Same inputs and outputs as `decode.launch_decode` (page tables, lengths, flat page storage, the
stacked protection rows; `o` (B, H, d_c) float32 and its log-sum-exp), so an engine calls one or
the other by device. Each step gathers the batch's pages once, unpacks the codes through a
byte → codes lookup table, dequantizes per group and runs one softmax over the packed region and
the protected rows together. `decode_rows` is the same attention over BF16 row pages (an engine's
unquantized cache), so the two are timed against each other on equal terms. Tested against the
float64 `reference.decode_reference`.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from quantmla.memory import CacheLayout
from quantmla_kernels.paged_cache.layout import check_packable, paths


@lru_cache(maxsize=None)
def _unpack_table(bits: int, device: torch.device) -> torch.Tensor:
    """(256, 8 // bits) float32: the codes of every byte, lowest bits first (`quant.pack`)."""
    byte = torch.arange(256, dtype=torch.int64)
    shifts = torch.arange(0, 8, bits)
    return ((byte[:, None] >> shifts) & ((1 << bits) - 1)).float().to(device)


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

        codes = _unpack_table(path.bits, storage.device)[section("codes", path.row_bytes).long()]
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


def _attend(q_lat, q_rope, scaling, regions):
    """One softmax over every region [(ĉ (B, T, d_c), k̂ (B, T, d_r), keep (B, T))]: (o, lse)."""
    q_lat, q_rope = q_lat.float(), q_rope.float()
    scores = [
        torch.where(
            keep[:, None, :],
            scaling * (q_lat @ c.transpose(1, 2) + q_rope @ k.transpose(1, 2)),
            float("-inf"),
        )
        for c, k, keep in regions
    ]
    scores = torch.cat(scores, dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    values = torch.cat([c for c, _, _ in regions], dim=1)
    return p @ values, lse


def decode_packed(
    *, q_lat, q_rope, scaling, table, lens, layout: CacheLayout, storage, prot=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, H, d_c) float32, lse (B, H)) over packed pages (all but the protected tokens) and
    the stacked protection rows `prot` (B, sink + recent, d_c + d_r)."""
    n_pages = max(1, math.ceil(int(lens.max()) / layout.page_tokens))
    c_hat, k_hat = dequantize_pages(storage, layout, table, n_pages)
    pos = torch.arange(n_pages * layout.page_tokens, device=lens.device)[None, :]
    t = lens.to(torch.int64)[:, None]
    regions = []
    if layout.quantized and prot is not None:
        keep = (pos < t) & (pos >= layout.sink) & (pos < t - layout.recent)
        _, valid = _protected_positions(lens, layout.sink, layout.recent, prot.shape[1])
        rows = prot.float()
        regions = [(c_hat, k_hat, keep), (rows[..., : layout.d_c], rows[..., layout.d_c :], valid)]
    else:
        regions = [(c_hat, k_hat, pos < t)]
    return _attend(q_lat, q_rope, scaling, regions)


def decode_rows(*, q_lat, q_rope, scaling, table, lens, pages, d_c: int):
    """The same attention over row pages (n_pages, page, d_c + d_r) of any float dtype (every
    token unquantized): the BF16 cache of an engine."""
    n_pages = max(1, math.ceil(int(lens.max()) / pages.shape[1]))
    index = table[:, :n_pages].reshape(-1).to(torch.int64)
    rows = pages.index_select(0, index).view(table.shape[0], -1, pages.shape[-1]).float()
    pos = torch.arange(rows.shape[1], device=lens.device)[None, :]
    keep = pos < lens.to(torch.int64)[:, None]
    return _attend(q_lat, q_rope, scaling, [(rows[..., :d_c], rows[..., d_c:], keep)])
