"""The cache's three ops, one entry point each — write, dequantize (a chunked prefill's context),
decode — and the one rule that picks their implementation: `kernel="auto"` runs the Triton
kernels on CUDA and the torch / C++ CPU path elsewhere; `"triton"` or `"torch"` forces one (Triton
on a CPU needs TRITON_INTERPRET=1). The pool-level forms (`write_tokens`, `decode_pool`) serve the
packed cache of `quantmla.generate`; the block-table forms serve an engine's cache."""

from __future__ import annotations

import torch

from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.memory import CacheLayout
from quantmla.spec import KERNELS, QuantizerSpec
from quantmla_kernels.paged_cache import cpu, native
from quantmla_kernels.paged_cache.decode import launch_decode
from quantmla_kernels.paged_cache.gather import gather_pages
from quantmla_kernels.paged_cache.layout import check_packable, kept_in_protection, protection_slots
from quantmla_kernels.paged_cache.pool import PagePool, stacked_inputs
from quantmla_kernels.paged_cache.writer import write_torch, write_triton


def resolve(kernel: str, device: torch.device | str) -> str:
    """The implementation `kernel` names on `device`: auto is Triton on CUDA, torch elsewhere."""
    if kernel not in KERNELS:
        raise ConfigError("kernel", kernel, KERNELS)
    if kernel != "auto":
        return kernel
    return "triton" if torch.device(device).type == "cuda" else "torch"


def warm_up(kernel: str, device: torch.device | str) -> None:
    """Build what the chosen implementation needs before a timed step: the C++ CPU op."""
    if resolve(kernel, device) == "torch" and torch.device(device).type == "cpu":
        native.available()


# --------------------------------------------------------------------------------------- write


def write(storage, layout: CacheLayout, pages, slots, c, k_r, kernel: str = "auto") -> None:
    """Pack token rows `c` (n, d_c), `k_r` (n, d_r) into (page, slot) of `storage` (n_pages,
    page_bytes) uint8: a pool's, or an engine's block tensor viewed as pages. On a CPU the C++
    writer where it builds (the same bytes as the torch writer), else the torch writer."""
    if resolve(kernel, storage.device) == "triton":
        write_triton(storage, layout, pages, slots, c, k_r)
    elif storage.device.type == "cpu" and native.available():
        native.native_write(storage, layout, pages, slots, c, k_r)
    else:
        write_torch(storage, layout, pages, slots, c, k_r)


def write_tokens(
    pool: PagePool, request_id: int, c: torch.Tensor, k_r: torch.Tensor, kernel: str = "auto"
) -> None:
    """Append `c` (n, d_c) and `k_r` (n, d_r) to a request: all or nothing. Protected tokens (the
    first `sink`, a ring of the last `recent`) are also copied to the request's BF16 buffer, and
    every token is packed, so a token leaving the recent window needs no rewrite. Non-finite input
    (`NonFiniteCacheError`) and a pool without room (`PoolExhaustedError`) stop before any write."""
    layout = pool.layout
    check_packable(layout)
    if c.shape[-1] != layout.d_c or k_r.shape[-1] != layout.d_r or c.shape[0] != k_r.shape[0]:
        raise ConfigError(
            "writer input shapes",
            (tuple(c.shape), tuple(k_r.shape)),
            f"(n, {layout.d_c}), (n, {layout.d_r})",
        )
    for name, t in (("c", c), ("k_R", k_r)):
        bad = ~torch.isfinite(t).all(dim=-1)
        if bad.any():
            raise NonFiniteCacheError(
                f"request {request_id}: {name} has NaN/Inf at new token(s) "
                f"{bad.nonzero().flatten().tolist()[:8]}; nothing was written"
            )
    kernel = resolve(kernel, pool.device)
    n = c.shape[0]
    pool.reserve(request_id, n)  # raises before anything is written
    request = pool.request(request_id)
    pos = torch.arange(request.tokens - n, request.tokens)
    page = layout.page_tokens
    pages = request.page_table()[pos // page].to(pool.device)
    write(pool.storage, layout, pages, (pos % page).to(pool.device), c, k_r, kernel)
    if layout.quantized:
        keep = kept_in_protection(pos, request.tokens, layout.sink, layout.recent)
        slot = protection_slots(pos, layout.sink, layout.recent)[keep]
        rows = torch.cat([c, k_r], dim=-1)[keep].to(request.protection.dtype)
        request.protection[slot.to(request.protection.device)] = rows.to(request.protection.device)


# ---------------------------------------------------------------------------------- dequantize


def dequantize(storage, layout: CacheLayout, pages, workspace=None, kernel: str = "auto"):
    """(ĉ (n·page, d_c), k̂_R (n·page, d_r)) of packed pages `pages` (n,): by the Triton gather
    into `workspace` (rows ≥ n·page, d_c + d_r) on CUDA, by the CPU path (float32) elsewhere."""
    pages = pages.to(torch.int64)
    if resolve(kernel, storage.device) == "triton":
        if workspace is None:
            workspace = torch.empty(
                pages.shape[0] * layout.page_tokens, layout.d_c + layout.d_r, device=storage.device
            )
        rows = gather_pages(storage, layout, pages, workspace)
        return rows[:, : layout.d_c], rows[:, layout.d_c :]
    c, k_r = cpu.dequantize_pages(storage, layout, pages[None], pages.shape[0])
    return c[0], k_r[0]


# -------------------------------------------------------------------------------------- decode


def decode(
    *, q_lat, q_rope, scaling, table, lens, layout: CacheLayout, storage, prot, prot_slots=None,
    kernel="auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(o (B, H, d_c) float32, lse (B, H)) of one query token per request over its packed pages
    (block table `table`, lengths `lens`) and its protection rows: `prot` (B, sink + recent,
    d_c + d_r), or with `prot_slots` (B,) row prot_slots[b] of a buffer (slots, sink + recent,
    d_c + d_r) (the CPU op reads it in place)."""
    args = dict(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table.to(torch.int64), lens=lens,
        layout=layout, storage=storage, prot=prot,
    )  # fmt: skip
    if resolve(kernel, storage.device) == "triton":
        if prot is not None and prot_slots is not None:
            args["prot"] = prot.index_select(0, prot_slots.to(prot.device))
        return launch_decode(**args)
    return cpu.decode_packed(**args, prot_slots=prot_slots)


def decode_pool(pool: PagePool, request_ids, q_lat, q_rope, scaling, kernel: str = "auto"):
    """`decode` over a pool's requests (their page tables and protection buffers)."""
    table, lens, prot = stacked_inputs(pool, request_ids)
    return decode(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, layout=pool.layout,
        storage=pool.storage, prot=prot, kernel=kernel,
    )  # fmt: skip


def decode_rows(*, q_lat, q_rope, scaling, table, lens, pages, d_c: int, kernel="auto"):
    """The same attention over row pages (n_pages, page tokens, d_c + d_r) of any float dtype,
    every token unquantized: an engine's BF16 cache."""
    if resolve(kernel, pages.device) == "triton":
        # the kernel's row mode reads only the geometry; any packable spec gives its constants
        layout = CacheLayout(
            QuantizerSpec(4, 4), d_c, pages.shape[-1] - d_c, page_tokens=pages.shape[1]
        )
        return launch_decode(
            q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table.to(torch.int64),
            lens=lens.to(torch.int32), layout=layout,
            storage=torch.empty(1, dtype=torch.uint8, device=pages.device), bf16_pages=pages,
        )  # fmt: skip
    return cpu.decode_rows(
        q_lat=q_lat, q_rope=q_rope, scaling=scaling, table=table, lens=lens, pages=pages, d_c=d_c
    )
