"""The packed layout as the kernels see it: the two cached paths, whether a layout can be packed,
and the compile-time constants (dims, bits, metadata bytes, page size, section offsets), all read
from the one `quantmla.memory.CacheLayout`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.errors import ConfigError
from quantmla.memory import CacheLayout
from quantmla.quant import PACKABLE_BITS, pack_word


@dataclass(frozen=True)
class Path:
    """One cached path (content latent or RoPE key) in a layout."""

    name: str  # "content" | "rope"
    dim: int
    bits: int
    meta_dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.dim * self.bits // 8


def paths(layout: CacheLayout) -> tuple[Path, Path]:
    s = layout.spec
    return (
        Path("content", layout.d_c, s.content_bits, getattr(torch, s.content_meta_dtype)),
        Path("rope", layout.d_r, s.rope_bits, getattr(torch, s.rope_meta_dtype)),
    )


def check_packable(layout: CacheLayout) -> None:
    """One line for a layout the packed cache cannot hold."""
    s = layout.spec
    if not s.packable:
        raise ConfigError(
            f"precision {s.precision} (packed cache)",
            "an FP8, FP4 or codebook path",
            "integer codes for the packed writer and decode (FP8 formats and the engine formats: "
            "cache.backend=simulator; the memory model counts their bytes)",
        )
    for path in paths(layout):
        if path.bits not in PACKABLE_BITS:
            raise ConfigError(
                f"{path.name} bits (precision {s.precision})",
                path.bits,
                f"{PACKABLE_BITS} for the packed cache (16-bit paths: cache.backend=simulator)",
            )
        if path.dim % s.group_size:
            raise ConfigError(
                "group_size", s.group_size, f"a divisor of {path.name} dim {path.dim}"
            )


def layout_constants(layout: CacheLayout) -> dict:
    """The kernels' compile-time description of a layout: dims, bits, metadata bytes and each
    section's byte offset inside a page."""
    check_packable(layout)
    content, rope = paths(layout)
    if torch.float16 in (content.meta_dtype, rope.meta_dtype):
        raise ConfigError("metadata dtype (Triton kernels)", "float16", ("bfloat16", "float32"))
    sec = layout.sections()
    out = {"D_C": layout.d_c, "D_R": layout.d_r, "GROUP": layout.spec.group_size}
    out["PAGE_BYTES"] = layout.page_bytes()
    for prefix, path in (("C", content), ("R", rope)):
        out[f"{prefix}_BITS"] = path.bits
        out[f"{prefix}_WORD"] = pack_word(path.bits)[0]  # bytes of one packed word
        out[f"{prefix}_META"] = path.meta_dtype.itemsize
        for kind in ("codes", "scales", "zeros"):
            out[f"{prefix}_{kind.upper()}"] = sec[f"{path.name}_{kind}"][0]
    return out


def protection_slots(pos: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Row of a protection buffer that holds token `pos`: sinks at their position, every later
    token in the ring slot sink + pos % recent (the decode kernel reads the same rows)."""
    return torch.where(pos < sink, pos, sink + pos % max(recent, 1))


def kept_in_protection(pos: torch.Tensor, tokens: int | torch.Tensor, sink: int, recent: int):
    """Bool: which of the new tokens at `pos` a buffer of a `tokens`-long sequence must hold."""
    return (pos < sink) | (pos >= tokens - recent)


def held_positions(tokens: int, sink: int, recent: int) -> torch.Tensor:
    """Positions a protection buffer holds for a `tokens`-long sequence, in order: the sinks and
    the last `recent` (those of `kept_in_protection`)."""
    ring = torch.arange(min(tokens, max(sink, tokens - recent)), tokens)
    return torch.cat([torch.arange(min(sink, tokens)), ring])
