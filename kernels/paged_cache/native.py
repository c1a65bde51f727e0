"""The C++ CPU ops beside the torch path (`dequant.cpp`: packed pages → float32 rows, the writer:
rows → packed bytes at (page, slot), and the fused decode over packed or row pages; `prefill.cpp`:
a quantized prefill chunk's pass over its exact copies, merged in place), built on
first use by torch's cpp_extension (a C++ compiler and ninja; cached under torch's extensions
folder). Where they cannot be built, or
`QUANTMLA_NATIVE=0`, `available()` is False and the callers keep the torch path
(`cpu.dequantize_pages_torch`, `writer.write_torch`), after one printed line."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import torch

from quantmla.memory import CacheLayout
from quantmla_kernels.paged_cache.layout import check_packable, paths

SOURCES = [str(Path(__file__).with_name(name)) for name in ("dequant.cpp", "prefill.cpp")]
META_KIND = {torch.float32: 4, torch.bfloat16: 2, torch.float16: -2}


@cache
def _ops():
    if os.environ.get("QUANTMLA_NATIVE", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    # OpenMP spreads the ops' tasks over the cores (without it at::parallel_for runs serially);
    # a compiler without it (Apple clang) still builds them, serial
    for threads in (["-fopenmp"], []):
        try:
            load(
                name="quantmla_cpu_ops", sources=SOURCES, is_python_module=False,
                extra_cflags=["-O3", "-march=native", *threads], extra_ldflags=threads,
                verbose=False,
            )  # fmt: skip
            return torch.ops.quantmla
        except Exception as err:  # no compiler, no ninja, a build error: the torch path serves
            error = err
    print(f"[quantmla] C++ CPU op unavailable ({type(error).__name__}: {error}); torch path used")
    return None


def available() -> bool:
    return _ops() is not None


@cache
def path_constants(layout: CacheLayout) -> tuple[tuple[int, ...], ...]:
    """Each path's (dim, bits, group, codes, scales, zeros, meta kind, first column) for the op
    (cached: a layout is frozen, and the ops are called per layer and step)."""
    check_packable(layout)
    sections, column, out = layout.sections(), 0, []
    for p in paths(layout):
        out.append((
            p.dim, p.bits, layout.spec.group_size, sections[f"{p.name}_codes"][0],
            sections[f"{p.name}_scales"][0], sections[f"{p.name}_zeros"][0],
            META_KIND[p.meta_dtype], column,
        ))  # fmt: skip
        column += p.dim
    return tuple(out)


def native_dequantize(storage, layout: CacheLayout, pages, keep=None) -> torch.Tensor:
    """(pages · page tokens, d_c + d_r) float32 rows of `pages` (int64 indices into `storage`),
    zero where `keep` (bool, one per row) is False. Requires `available()`."""
    tokens = pages.numel() * layout.page_tokens
    if keep is None:
        keep = torch.ones(tokens, dtype=torch.bool)
    content, rope = path_constants(layout)
    return _ops().dequantize_pages(
        storage, pages.reshape(-1).to(torch.int64), keep.reshape(-1).contiguous(),
        layout.page_tokens, content, rope,
    )  # fmt: skip


def native_write(storage, layout: CacheLayout, pages, slots, c, k_r) -> None:
    """`writer.write_torch` by the C++ op: rows c (n, d_c), k_r (n, d_r) quantized and packed into
    (page, slot) of `storage` (n_pages, page_bytes) uint8. Requires `available()`."""
    content, rope = path_constants(layout)
    _ops().quantize_pages(
        storage, pages.reshape(-1).to(torch.int64).contiguous(),
        slots.reshape(-1).to(torch.int64).contiguous(), c.float().contiguous(),
        k_r.float().contiguous(), layout.page_tokens, content, rope,
    )  # fmt: skip


def native_decode(storage, layout: CacheLayout, table, lo, hi, q, prot, slots, lens, scaling):
    """(o (B, H, d_c), lse (B, H)) of queries q (B, H, d_c + d_r) float32 over positions
    [lo_b, hi_b) of each request's packed pages (`table` (B, pages) int64) and, where `prot`
    (slots, sink + recent, width) float32 or bfloat16 is not empty, the protection rows of buffer
    slot `slots[b]` that hold a position of a `lens[b]`-token request (int64 (B,) both)."""
    content, rope = path_constants(layout)
    return _ops().decode_pages(
        storage, table, lo, hi, q, prot, slots, lens, layout.sink, layout.recent, float(scaling),
        layout.page_tokens, content, rope,
    )  # fmt: skip


def native_decode_rows(pages, table, lo, hi, q, scaling, d_c: int):
    """The same over row pages (pages, page tokens, d_c + d_r), float32 or bfloat16."""
    return _ops().decode_rows(pages, table, lo, hi, q, float(scaling), d_c)


def native_window_merge(q, keys, values, sink_pos, base, start, recent, scaling, out, lse) -> None:
    """`prefill.merge_window` by the C++ op: q (H, n, W), keys (H, m, W), values (H, m, d_v), the
    first len(sink_pos) keys the sinks, the rest at positions base ..; out / lse updated in place."""
    _ops().window_merge(
        q, keys, values, [int(p) for p in sink_pos], int(base), int(start), int(recent),
        float(scaling), out, lse,
    )  # fmt: skip
