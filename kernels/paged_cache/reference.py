"""Test oracles of the packed cache, built on the one quantizer (`quantmla.quant`), never imported
by production code (a test keeps it so): the reader (`read_tokens`) and float64 decode
(`decode_reference`). Every decode and gather path is tested against these; the writers against
each other and against the reader."""

from __future__ import annotations

import torch

from quantmla.quant import Quantized, dequantize, unpack
from quantmla_kernels.paged_cache.layout import paths, protection_slots
from quantmla_kernels.paged_cache.pool import PagePool


def read_tokens(pool: PagePool, request_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference reader: every token of a request dequantized from its pages, (T, d_c), (T, d_r)
    float32 — what the simulator's quantize-dequantize gives for the same rows."""
    layout, request = pool.layout, pool.request(request_id)
    pos = torch.arange(request.tokens)
    pages = request.page_table()[pos // layout.page_tokens].to(pool.device)
    slots = (pos % layout.page_tokens).to(pool.device)
    flat, page_bytes, g = pool.storage.view(-1), layout.page_bytes(), layout.spec.group_size
    out = []
    for path in paths(layout):
        groups = path.dim // g
        fields = {}
        for kind, row in (
            ("codes", path.row_bytes),
            ("scales", groups * path.meta_dtype.itemsize),
            ("zeros", groups),
        ):
            start, _ = layout.sections()[f"{path.name}_{kind}"]
            index = (pages * page_bytes + start + slots * row)[:, None] + torch.arange(
                row, device=pool.device
            )
            fields[kind] = flat[index]
        q = Quantized(
            unpack(fields["codes"], path.bits).reshape(-1, groups, g),
            fields["scales"].contiguous().view(path.meta_dtype).reshape(-1, groups, 1),
            fields["zeros"].reshape(-1, groups, 1).to(path.meta_dtype),
            path.bits,
        )
        out.append(dequantize(q))
    return out[0], out[1]


def protected_positions(tokens: int, sink: int, recent: int) -> torch.Tensor:
    """Bool (tokens,): positions the decode step reads from the BF16 buffer (SPEC's protection for
    the query at the last slot: j < sink or j ≥ T − recent)."""
    j = torch.arange(tokens)
    return (j < sink) | (j >= tokens - recent)


def protected_rows(pool: PagePool, request_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, rows (n, d_c + d_r) float32) the request's protection buffer holds now."""
    layout, request = pool.layout, pool.request(request_id)
    pos = protected_positions(request.tokens, layout.sink, layout.recent).nonzero().flatten()
    slot = protection_slots(pos, layout.sink, layout.recent)
    return pos, request.protection[slot.to(request.protection.device)].float()


def decode_reference(pool, request_ids, q_lat, q_rope, scaling):
    """float64 reference: (o (B, H, d_c), lse (B, H))."""
    layout = pool.layout
    outs, lses = [], []
    for b, rid in enumerate(request_ids):
        c, k = read_tokens(pool, rid)
        pos, rows = protected_rows(pool, rid)
        c, k = c.double().clone(), k.double().clone()
        c[pos], k[pos] = rows[:, : layout.d_c].double(), rows[:, layout.d_c :].double()
        scores = scaling * (q_lat[b].double() @ c.T + q_rope[b].double() @ k.T)  # (H, T)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.softmax(scores, dim=-1) @ c)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
