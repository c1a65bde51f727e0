"""MLA attention over a mixed-precision latent cache, in expanded or absorbed form (docs/method.md §1, §5).

The cache holds, per layer, the latent `C` (T × d_c) and the RoPE key `K_R` (T × d_r) twice: as
written (BF16/model dtype) and quantize-dequantized. Query t reads token j from the unquantized
copy iff j is *protected* (j < sink or t − j < recent), otherwise from the dequantized copy: every
token exactly once, nothing evicted.

- Expanded form (prefill): keys/values of both copies are expanded through `kv_b_proj` and one
  softmax runs over the two copies with complementary masks (a single fused SDPA call).
- Absorbed form (decode): `q̃ = q^C W_UKᵀ` scores the latent directly; the quantized region and the
  gathered protected rows are computed separately and merged by the online-softmax rule.
Both forms compute the same function; `choose_form` picks the cheaper one per call.
- Causal prefill (`prefill_attention`: the serving backend's prefill chunks, and the simulator's
  forwards whose mask is causal): the same function without a dense mask — the dequantized copies
  read under the causal rule shifted by `recent`, the exact copies as the sinks and a band, in
  fused passes (torch's fused CPU attention, a C++ band op) merged by their log-sum-exp. Every
  (query, key) pair is scored once, where the masked SDPA scores both copies of every key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from quantmla.quant import qdq_content, qdq_rope
from quantmla_kernels.paged_cache.prefill import attend, merge_states, merge_window


def _acc(x: torch.Tensor) -> torch.Tensor:
    """At least float32 for softmax and accumulation (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class SoftmaxPartial(NamedTuple):
    """One region's softmax statistics: row max m, exp-sum ℓ, unnormalised weighted sum o."""

    m: torch.Tensor  # (..., n, 1)
    l: torch.Tensor  # (..., n, 1)  # noqa: E741
    o: torch.Tensor  # (..., n, d)


def softmax_partial(
    scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor
) -> SoftmaxPartial:
    """Partial softmax of `scores` (..., n, T) restricted to `allowed`, applied to `values` (..., T, d)."""
    scores = _acc(scores).masked_fill(~allowed, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe)
    values = _acc(values)
    if values.dim() == 4 and values.shape[1] == 1 < p.shape[1]:
        # one latent shared by every head (absorbed MLA): heads folded into rows, one bmm — a
        # broadcast matmul would copy the latent once per head (decode: most of its time)
        o = (p.flatten(1, 2) @ values[:, 0]).view(*p.shape[:-1], values.shape[-1])
    else:
        o = p @ values
    return SoftmaxPartial(m, p.sum(dim=-1, keepdim=True), o)


def merge_partials(*parts: SoftmaxPartial) -> torch.Tensor:
    """Online-softmax merge (docs/method.md §5): m = max mᵢ, ℓ = Σ e^{mᵢ−m} ℓᵢ, o = Σ e^{mᵢ−m} oᵢ / ℓ.

    Empty regions (m = −inf) weigh zero; a row empty in every region returns zeros.
    """
    m = torch.stack([p.m for p in parts]).amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    weights = [torch.exp(p.m - m_safe) for p in parts]
    l_total = sum(w * p.l for w, p in zip(weights, parts))
    o_total = sum(w * p.o for w, p in zip(weights, parts))
    return o_total / torch.where(l_total > 0, l_total, torch.ones_like(l_total))


def protected_mask(
    q_slots: torch.Tensor, kv_len: int, sink: int, recent: int, first: torch.Tensor | None = None
) -> torch.Tensor:
    """(n, T) bool: key j is read unquantized by query slot t iff j < sink or t − j < recent.
    With `first` (B,), each sequence's first real slot (left padding), the sinks are slots
    first .. first + sink − 1 of that sequence: (B, 1, n, T)."""
    j = torch.arange(kv_len, device=q_slots.device)
    recent_band = q_slots[:, None] - j[None, :] < recent
    if first is None:
        return (j[None, :] < sink) | recent_band
    own = j[None, :] - first.to(j.device)[:, None]  # (B, T): position within the sequence
    return ((own >= 0) & (own < sink))[:, None, None, :] | recent_band[None, None]


def first_real_slot(allowed: torch.Tensor) -> torch.Tensor:
    """(B,) the first key each sequence's last query may read in `allowed` (B, 1, n, T): the
    left padding's length (0 unpadded; the last query of a left-padded batch is always real)."""
    return allowed[:, 0, -1, :].int().argmax(dim=-1)


def choose_form(n_queries: int, n_keys: int, d_c: int, d_r: int, d_nope: int, d_v: int) -> str:
    """Cheaper of the two forms by multiply-add count per head; `n_keys` sums over all regions."""
    expanded = n_keys * d_c * (d_nope + d_v) + n_queries * n_keys * (d_nope + d_r + d_v)
    absorbed = n_queries * (d_nope * d_c + d_c * d_v) + n_queries * n_keys * (2 * d_c + d_r)
    return "absorbed" if absorbed < expanded else "expanded"


def sdpa(q, k, v, attn_mask=None, scale=None, is_causal=False):
    """`F.scaled_dot_product_attention`, with MLA's narrower values zero-padded to the query width
    on a CPU: its flash kernel needs equal head dims, the math fallback is ~4x slower (2,048
    tokens, 9 heads of 128 + 64: 0.09 s vs 0.37 s); the padded columns are dropped again."""
    d_v = v.shape[-1]
    if q.device.type != "cpu" or d_v == q.shape[-1]:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal
        )
    padded = F.pad(v, (0, q.shape[-1] - d_v))
    out = F.scaled_dot_product_attention(
        q, k, padded, attn_mask=attn_mask, scale=scale, is_causal=is_causal
    )
    return out[..., :d_v]


def expanded_attention(q_nope, q_rot, regions, w_kv_b, d_nope, scaling):
    """Expand every region's latent to per-head K/V, one SDPA over all regions with disjoint masks.

    regions: list of (c (B,T,d_c), k_rot (B,T,d_r), allowed (B,1,n,T) bool).
    Returns (B, H, n, d_v).
    """
    b, h, n, _ = q_nope.shape
    c = torch.cat([r[0] for r in regions], dim=1)
    k_rot = torch.cat([r[1] for r in regions], dim=1)
    allowed = torch.cat([r[2] for r in regions], dim=-1)
    allowed = allowed | ~allowed.any(
        dim=-1, keepdim=True
    )  # rows with no key (padding): finite, unused
    kv = F.linear(c, w_kv_b).view(b, c.shape[1], h, -1).transpose(1, 2)
    k_nope, v = kv.split([d_nope, kv.shape[-1] - d_nope], dim=-1)
    k = torch.cat([k_nope, k_rot[:, None].expand(b, h, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_rot], dim=-1)
    return sdpa(q, k, v, attn_mask=allowed, scale=scaling)


def absorbed_attention(q_nope, q_rot, regions, w_uk, w_uv, scaling):
    """Score the latent directly: q̃ = q^C W_UKᵀ, one softmax partial per region, online merge,
    then W_UV per head. Same arguments as `expanded_attention`, W_UK (H,d_nope,d_c), W_UV (H,d_v,d_c)."""
    q_abs = torch.einsum("bhnd,hdc->bhnc", _acc(q_nope), _acc(w_uk))
    parts = []
    for c, k_rot, allowed in regions:
        scores = torch.einsum("bhnc,btc->bhnt", q_abs, _acc(c)) + torch.einsum(
            "bhnr,btr->bhnt", _acc(q_rot), _acc(k_rot)
        )
        parts.append(softmax_partial(scores * scaling, allowed, c[:, None]))
    latent = merge_partials(*parts)  # (B, H, n, d_c)
    return torch.einsum("bhnc,hvc->bhnv", latent, _acc(w_uv)).to(q_nope.dtype)


def causal_regions(c: torch.Tensor, k_rot: torch.Tensor) -> list:
    """One region over a whole sequence (no cache, no protection): calibration and analysis."""
    n = c.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool, device=c.device).tril()[None, None]
    return [(c, k_rot, allowed.expand(c.shape[0], 1, n, n))]


def attention_output(module, adapter, q_nope, q_rot, regions, form: str = "auto", geometry=None):
    """Post-`o_proj` attention output (B, n, hidden) of one MLA module's query parts over latent-cache
    regions; `form="auto"` picks the cheaper of the expanded and absorbed forms."""
    geometry = geometry or adapter.geometry(module)
    b, _, n, _ = q_nope.shape
    if form == "auto":
        n_keys = sum(r[0].shape[1] for r in regions)
        form = choose_form(n, n_keys, geometry.d_c, geometry.d_r, geometry.d_nope, geometry.d_v)
    if form == "absorbed":
        w_uk, w_uv = adapter.up_projections(module)
        out = absorbed_attention(q_nope, q_rot, regions, w_uk, w_uv, geometry.scaling)
    else:
        out = expanded_attention(
            q_nope, q_rot, regions, module.kv_b_proj.weight, geometry.d_nope, geometry.scaling
        )
    return module.o_proj(out.transpose(1, 2).reshape(b, n, -1).to(module.o_proj.weight.dtype))


def cache_regions(policy, c, k_rot, allowed, q_slots, hats=None):
    """[(c, k_R, allowed)] per region under a `CachePolicy`: the dequantized history (`hats` when the cache keeps it,
    else quantized here) and the gathered protected rows."""
    spec = policy.spec
    if not spec.quantized:
        return [(c, k_rot, allowed)]
    c_hat, k_hat = hats if hats is not None else (qdq_content(spec, c), qdq_rope(spec, k_rot))
    first = first_real_slot(allowed)
    protected = protected_mask(q_slots, c.shape[1], policy.sink, policy.recent, first)
    regions = []
    quant_allowed = allowed & ~protected
    if quant_allowed.any():
        regions.append((c_hat, k_hat, quant_allowed))
    raw_allowed = allowed & protected
    columns = raw_allowed.flatten(0, 2).any(dim=0).nonzero().squeeze(-1)
    if columns.numel():
        if columns.numel() < c.shape[1]:  # gather only the protected rows (decode: sink + recent)
            c, k_rot, raw_allowed = c[:, columns], k_rot[:, columns], raw_allowed[..., columns]
        regions.append((c, k_rot, raw_allowed))
    return regions or [(c_hat, k_hat, allowed)]


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
