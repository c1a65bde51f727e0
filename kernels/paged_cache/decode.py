"""Decode attention over the paged packed latent cache (absorbed form, one new token per request).

Scores s_t = τ (q̃ · ĉ_t + q_R · k̂_R,t) over every cached token: packed pages for tokens outside the
protection window, the request's BF16 buffer for the first `sink` and the last `recent`; output
the softmax-weighted latent o = Σ_t p_t ĉ_t (B, H, d_c) and its log-sum-exp (the caller applies
W_UV and W_O, as the simulator's absorbed form).

`launch_decode`: split-K over pages — each program takes a request's block of heads (all of them
when h_q ≤ BLOCK_H) and a run of pages, unpacks and dequantizes each 64-token tile once in
registers and uses it for both QK and PV (online softmax); one extra split attends to the
protected rows; a second kernel merges the splits by the log-sum-exp rule. With `bf16_pages` the
same kernel reads an unquantized paged cache (BF16 mode of an engine). Callers go through
`ops.decode`; tested against `reference.decode_reference`."""

from __future__ import annotations

import math

import torch

from quantmla_kernels.paged_cache.launch import compiles_for_gpu, launch
from quantmla_kernels.paged_cache.layout import layout_constants
from quantmla_kernels.paged_cache.tiles import DECODE_TILE, dequant_tile

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


# heads per program and warps: a 16-head block in 8 warps holds the d_c = 512 accumulator, the
# query and a tile in registers on sm_80 and sm_90 (222 registers, no spills); 32 or 64 heads, or
# 16 in 4 warps, spill (results/kernels_compile.json). h_q = 128 runs eight head blocks.
DECODE_BLOCK_H = 16
DECODE_WARPS = 8

# ------------------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit
    def _online_update(
        q, qr, c, k, keep, m_i, l_i, acc, scaling, DOT: tl.constexpr, PREC: tl.constexpr
    ):
        """One tile of the online softmax: scores, running max/sum, and PV with the same tile
        (fp32 operands multiply exactly — PREC "ieee" — on CPU; BF16 operands on a GPU); q and
        qr arrive in the dot dtype."""
        c = c.to(DOT)
        s = tl.dot(q, tl.trans(c), input_precision=PREC)
        s += tl.dot(qr, tl.trans(k.to(DOT)), input_precision=PREC)
        s = tl.where(keep[None, :], s * scaling, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), c, input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _decode_split_kernel(
        q_ptr,
        qr_ptr,
        store_ptr,
        bf16_ptr,
        table_ptr,
        lens_ptr,
        prot_ptr,
        o_ptr,
        lse_ptr,
        scaling,
        n_heads,
        max_pages,
        NUM_SPLITS,
        BLOCK_H: tl.constexpr,
        D_C: tl.constexpr,
        D_R: tl.constexpr,
        GROUP: tl.constexpr,
        PAGE_BYTES: tl.constexpr,
        C_BITS: tl.constexpr,
        C_WORD: tl.constexpr,
        C_META: tl.constexpr,
        C_CODES: tl.constexpr,
        C_SCALES: tl.constexpr,
        C_ZEROS: tl.constexpr,
        R_BITS: tl.constexpr,
        R_WORD: tl.constexpr,
        R_META: tl.constexpr,
        R_CODES: tl.constexpr,
        R_SCALES: tl.constexpr,
        R_ZEROS: tl.constexpr,
        SINK: tl.constexpr,
        RECENT: tl.constexpr,
        PROT_ROWS: tl.constexpr,
        DOT: tl.constexpr,
        PREC: tl.constexpr,
        BF16_PAGES: tl.constexpr,
        PAGE: tl.constexpr,
        TILE: tl.constexpr,
    ):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        T = tl.load(lens_ptr + b)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < n_heads
        dc = tl.arange(0, D_C)
        dr = tl.arange(0, D_R)
        q = tl.load(
            q_ptr + (b * n_heads + heads[:, None]) * D_C + dc[None, :],
            mask=hmask[:, None],
            other=0.0,
        )
        qr = tl.load(
            qr_ptr + (b * n_heads + heads[:, None]) * D_R + dr[None, :],
            mask=hmask[:, None],
            other=0.0,
        )
        q, qr = q.to(DOT), qr.to(DOT)  # once, not per tile
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, D_C), tl.float32)
        if split < NUM_SPLITS:  # a run of packed pages, TILE rows of a page at a time
            n_pages = tl.cdiv(T, PAGE)
            per_split = tl.cdiv(n_pages, NUM_SPLITS)
            first = split * per_split
            last = tl.minimum(first + per_split, n_pages)
            for page in range(first, last):
                phys = tl.load(table_ptr + b.to(tl.int64) * max_pages + page).to(tl.int64)
                base = phys * PAGE_BYTES  # int64 byte offset
                for sub in range(0, PAGE, TILE):  # not unrolled: one tile live at a time
                    rows = sub + tl.arange(0, TILE)
                    pos = page * PAGE + rows
                    if BF16_PAGES:  # the baseline: every token a BF16 row of a paged cache
                        keep = pos < T
                        at = (phys * PAGE + rows[:, None]) * (D_C + D_R)
                        c = tl.load(bf16_ptr + at + dc[None, :], mask=keep[:, None], other=0.0)
                        k = tl.load(
                            bf16_ptr + at + D_C + dr[None, :], mask=keep[:, None], other=0.0
                        )
                        c, k = c.to(tl.float32), k.to(tl.float32)
                    else:
                        keep = (pos < T) & (pos >= SINK) & (pos < T - RECENT)
                        c = dequant_tile(store_ptr, base, rows, D_C, GROUP, C_BITS, C_WORD,
                                          C_META, C_CODES, C_SCALES, C_ZEROS, TILE)  # fmt: skip
                        k = dequant_tile(store_ptr, base, rows, D_R, GROUP, R_BITS, R_WORD,
                                          R_META, R_CODES, R_SCALES, R_ZEROS, TILE)  # fmt: skip
                        c = tl.where(keep[:, None], c, 0.0)  # stale bytes past T: never 0·NaN
                        k = tl.where(keep[:, None], k, 0.0)
                    m_i, l_i, acc = _online_update(
                        q, qr, c, k, keep, m_i, l_i, acc, scaling, DOT, PREC
                    )
        else:  # the protected rows: sinks at their position, the ring at sink + pos % recent
            for start in range(0, PROT_ROWS, TILE):
                r = start + tl.arange(0, TILE)
                ring = r - SINK
                pos = tl.where(r < SINK, r, (T - 1) - ((T - 1 - ring) % RECENT))
                keep = (r < PROT_ROWS) & (pos >= 0) & (pos < T) & ((r < SINK) | (pos >= SINK))
                row_at = (b.to(tl.int64) * PROT_ROWS + r[:, None]) * (D_C + D_R)
                c = tl.load(prot_ptr + row_at + dc[None, :], mask=keep[:, None], other=0.0).to(
                    tl.float32
                )
                k = tl.load(
                    prot_ptr + row_at + D_C + dr[None, :], mask=keep[:, None], other=0.0
                ).to(tl.float32)
                m_i, l_i, acc = _online_update(q, qr, c, k, keep, m_i, l_i, acc, scaling, DOT, PREC)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = (b * (NUM_SPLITS + 1) + split) * n_heads + heads
        tl.store(o_ptr + part[:, None].to(tl.int64) * D_C + dc[None, :], o, mask=hmask[:, None])
        tl.store(lse_ptr + part, lse, mask=hmask)

    @triton.jit
    def _merge_kernel(
        o_ptr,
        lse_ptr,
        out_ptr,
        out_lse_ptr,
        n_heads,
        SPLITS,
        BLOCK_S: tl.constexpr,
        D_C: tl.constexpr,
    ):
        """Second stage: o = Σ e^{lse_s − m} o_s / Σ e^{lse_s − m}, lse = m + log Σ e^{lse_s − m};
        the splits' log-sum-exps as one vector, their outputs one d_c row at a time (all of them
        at once spilled: 128 splits × 512 floats)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        smask = s < SPLITS
        lse = tl.load(lse_ptr + (b * SPLITS + s) * n_heads + h, mask=smask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(lse - m_safe), axis=0)
        dc = tl.arange(0, D_C)
        out = tl.zeros((D_C,), tl.float32)
        for split in range(0, SPLITS):
            part = (b * SPLITS + split) * n_heads + h
            w = tl.exp(tl.load(lse_ptr + part) - m_safe)  # 0 for an empty split (lse −inf)
            out += w * tl.load(o_ptr + part.to(tl.int64) * D_C + dc)
        out = out / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + (b * n_heads + h) * D_C + dc, out)
        tl.store(
            out_lse_ptr + b * n_heads + h,
            tl.where(total > 0, m_safe + tl.log(total), float("-inf")),
        )


def default_splits(
    max_tokens: int, batch: int, page_tokens: int, target_programs: int = 132
) -> int:
    """Enough splits to give the GPU's SMs work (≈ one wave), never more than the pages."""
    pages = max(1, math.ceil(max_tokens / page_tokens))
    return max(1, min(pages, math.ceil(target_programs / max(batch, 1))))


def launch_configs(heads: int) -> list[dict]:
    """The launch configurations a benchmark tunes over: 16 or 32 heads per program (≤ the heads),
    4 or 8 warps. 64 heads need 185–189 KB of shared memory at d_c 512, over sm_80's 163 KB per
    block (results/kernels_compile.json), and spill on sm_90."""
    return [
        dict(block_h=bh, num_warps=w) for bh in (16, 32) if bh <= max(16, heads) for w in (4, 8)
    ]


def launch_decode(
    *,
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    scaling: float,
    table: torch.Tensor,
    lens: torch.Tensor,
    layout,
    storage: torch.Tensor,
    prot: torch.Tensor | None = None,
    bf16_pages: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_h: int | None = None,
    dot_dtype: torch.dtype | None = None,
    num_warps: int = DECODE_WARPS,
):
    """Both kernels on prepared inputs (graph-capturable; the benchmark calls it directly): the
    packed pages + `prot` rows, or with `bf16_pages` the same kernel over a BF16 paged cache."""
    B, H, _ = q_lat.shape
    splits = num_splits or default_splits(int(lens.max()), B, layout.page_tokens)
    block_h = block_h or DECODE_BLOCK_H
    interpreted = not compiles_for_gpu(q_lat)
    dot = {
        None: tl.float32 if interpreted else tl.bfloat16,
        torch.float32: tl.float32,
        torch.bfloat16: tl.bfloat16,
    }[dot_dtype]
    o_part = torch.empty(B, splits + 1, H, layout.d_c, dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty(B, splits + 1, H, dtype=torch.float32, device=q_lat.device)
    paged = bf16_pages is not None
    if interpreted and paged:
        bf16_pages = bf16_pages.float()
    if interpreted and prot is not None:
        prot = prot.float()
    launch(
        _decode_split_kernel,
        (B, triton.cdiv(H, block_h), splits + 1),
        q_lat.float().contiguous(),
        q_rope.float().contiguous(),
        storage,
        bf16_pages if paged else storage,
        table,
        lens,
        prot.contiguous() if prot is not None else storage,
        o_part,
        lse_part,
        float(scaling),
        H,
        table.shape[1],
        NUM_SPLITS=splits,
        BLOCK_H=block_h,
        **layout_constants(layout),
        SINK=layout.sink,
        RECENT=max(layout.recent, 1),
        PROT_ROWS=0 if paged else layout.sink + layout.recent,
        DOT=dot,
        PREC="ieee" if dot == tl.float32 else "tf32",
        BF16_PAGES=paged,
        PAGE=layout.page_tokens,
        TILE=min(DECODE_TILE, layout.page_tokens),
        num_warps=num_warps,
    )
    out = torch.empty(B, H, layout.d_c, dtype=torch.float32, device=q_lat.device)
    out_lse = torch.empty(B, H, dtype=torch.float32, device=q_lat.device)
    launch(
        _merge_kernel,
        (B, H),
        o_part,
        lse_part,
        out,
        out_lse,
        H,
        SPLITS=splits + 1,
        BLOCK_S=triton.next_power_of_2(splits + 1),
        D_C=layout.d_c,
    )
    return out, out_lse
