"""The backend's math on an engine's tensors (no vLLM import): write tokens through a slot
mapping, prefill with a quantized history, decode over block tables.

Prefill attends as the simulator does (docs/simulator.md): query i reads token j unquantized iff
j < sink or i − j < recent, the dequantized copy otherwise — the two copies expanded through
`kv_b_proj` and one softmax over both with complementary masks, in chunks of queries so the
score block stays small at long prompts; a chunk gathers only the keys one of its queries reads
in each copy (about n + sink + recent + chunk instead of 2n). Decode reads packed pages and the request's protection
rows with the Triton kernels on CUDA and the vectorized torch path elsewhere; both return the
softmax-weighted latent, to which the engine applies W_UV itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantmla.memory import CacheLayout
from quantmla.quant import qdq_content, qdq_rope
from quantmla.spec import QuantizerSpec
from quantmla_kernels.paged_cache.cpu import decode_packed, decode_rows
from quantmla_kernels.paged_cache.writer import write_slots

PREFILL_CHUNK = 512  # queries per score block in prefill


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
        write_slots(storage, layout, slots // page, slots % page, c, k_r, kernel)


def write_rows(kv_cache, slot_mapping, c, k_r) -> None:
    """BF16 mode: each token one row [c | k_R] of the engine's row pages."""
    slots = slot_mapping.flatten().to(torch.int64)
    flat = kv_cache.view(-1, c.shape[-1] + k_r.shape[-1])
    rows = torch.cat([c[: slots.shape[0]], k_r[: slots.shape[0]]], dim=-1)
    valid = slots >= 0
    flat[slots[valid]] = rows[valid].to(flat.dtype)


def prefill_attention(q, c, k_r, kv_b_proj, spec, sink, recent, d_nope, d_v, scaling):
    """(n, H · d_v) attention output of one request's whole prompt over its own tokens.

    q (n, H, d_nope + d_r), c (n, d_c), k_r (n, d_r); `kv_b_proj(x)` → (n, H · (d_nope + d_v))."""
    n, heads = q.shape[0], q.shape[1]

    def expand(latent, rope):
        kv = kv_b_proj(latent).view(n, heads, d_nope + d_v)
        k_nope, v = kv.split([d_nope, d_v], dim=-1)
        k = torch.cat([k_nope, rope[:, None, :].expand(n, heads, -1).to(k_nope.dtype)], dim=-1)
        return k.transpose(0, 1), v.transpose(0, 1)  # (H, n, ·)

    keys, values = expand(c, k_r)
    if spec.quantized:
        k_hat, v_hat = expand(qdq_content(spec, c), qdq_rope(spec, k_r))
    out = torch.empty(heads, n, d_v, dtype=values.dtype, device=q.device)
    qh = q.transpose(0, 1)
    j = torch.arange(n, device=q.device)
    for a in range(0, n, PREFILL_CHUNK):
        b = min(n, a + PREFILL_CHUNK)
        i = j[a:b, None]
        if not spec.quantized:
            k, v, mask = keys[:, :b], values[:, :b], j[None, :b] <= i
        else:
            # only the keys some query of the chunk reads in that copy: the dequantized ones end
            # `recent` before the chunk does, the exact ones are the sink and the recent window
            quantized_end, sink_end = max(0, b - recent), min(sink, b)
            window = max(sink_end, a - recent + 1)
            picks = (slice(0, quantized_end), slice(0, sink_end), slice(window, b))
            k = torch.cat([k_hat[:, picks[0]], keys[:, picks[1]], keys[:, picks[2]]], dim=1)
            v = torch.cat([v_hat[:, picks[0]], values[:, picks[1]], values[:, picks[2]]], dim=1)
            jj = torch.cat([j[picks[0]], j[picks[1]], j[picks[2]]])
            exact = torch.arange(jj.shape[0], device=q.device) >= quantized_end
            protected = (jj < sink) | (i - jj < recent)
            mask = (jj <= i) & (protected == exact)
        out[:, a:b] = F.scaled_dot_product_attention(
            qh[:, a:b], k, v, attn_mask=mask, scale=scaling
        )
    return out.transpose(0, 1).reshape(n, heads * d_v)


def decode_latent(q_lat, q_rope, scaling, table, lens, layout, storage, prot, kernel: str):
    """(B, H, d_c) float32 softmax-weighted latent over packed pages + protection rows."""
    args = dict(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table.to(torch.int64), lens=lens,
        layout=layout, storage=storage, prot=prot,
    )  # fmt: skip
    if kernel == "triton":
        from quantmla_kernels.paged_cache.decode import launch_decode

        return launch_decode(**args)[0]
    return decode_packed(**args)[0]


def decode_latent_rows(q_lat, q_rope, scaling, table, lens, kv_cache, d_c: int, kernel: str):
    """BF16 mode: the same over the engine's row pages (every token unquantized)."""
    if kernel == "triton":
        from quantmla_kernels.paged_cache.baselines import decode_bf16_pages

        # the kernel's row mode reads only the geometry; any packable spec resolves its constants
        layout = CacheLayout(
            QuantizerSpec(4, 4), d_c, kv_cache.shape[-1] - d_c, page_tokens=kv_cache.shape[1]
        )
        return decode_bf16_pages(
            kv_cache, table.to(torch.int64), lens.to(torch.int32), layout, q_lat, q_rope, scaling
        )[0]
    return decode_rows(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, pages=kv_cache, d_c=d_c
    )[0]
