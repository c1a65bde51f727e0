"""Persistent KV-cache memory of the paged, packed MLA cache (docs/method.md §6; paper Fig. 5a, App. C.5).

The paper states only totals (20,480 B per C4R4 page of 64 tokens, 132 × 576 × 2 B of BF16
protection per request and layer, 8 B of reverse page map per physical page). The per-token
layout below is our derivation, chosen to reproduce those totals exactly:

    content codes   d_c · b_c / 8            (512 · 4 / 8 = 256 B at INT4; BF16: 2 B/element)
    RoPE codes      d_r · b_r / 8            (64 · 4 / 8  =  32 B)
    content meta    per group: BF16 scale (2 B) + UINT8 zero point (1 B)   (8 groups: 24 B)
    RoPE meta       per group: FP32 scale (4 B) + UINT8 zero point (1 B)   (1 group: 5 B)
    metadata block padded to a multiple of 8 B                             (29 → 32 B)
    ⇒ C4R4: 256 + 32 + 32 = 320 B/token, 20,480 B per 64-token page.

A zero point z = round(−min/s) lies in [0, 2^b − 1] whenever the group's range contains 0, so one
byte holds it (the writer clamps it otherwise). Every token keeps its packed copy even while it is
protected; protection adds a fixed (sink + recent) × (d_c + d_r) × 2 B BF16 buffer per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantmla.spec import ENGINE_FORMATS, META_DTYPE_BYTES, UNQUANTIZED_BITS, QuantizerSpec

BF16_BYTES = 2
ZERO_POINT_BYTES = 1  # UINT8
PAGE_TOKENS = 64
PAGE_MAP_BYTES = 8  # reverse page map entry per physical page


@dataclass(frozen=True)
class CacheLayout:
    """Bytes of the packed cache for one quantizer spec, model geometry and protection window."""

    spec: QuantizerSpec
    d_c: int = 512
    d_r: int = 64
    sink: int = 4
    recent: int = 128
    page_tokens: int = PAGE_TOKENS  # tokens per page: the kernels read it from here

    @property
    def quantized(self) -> bool:
        return self.spec.quantized

    def _codes(self, dim: int, bits: int) -> int:
        return dim * BF16_BYTES if bits >= UNQUANTIZED_BITS else dim * bits // 8

    def _groups(self, dim: int, fmt: str) -> int:
        engine = ENGINE_FORMATS.get(fmt)
        if engine is None:
            return dim // self.spec.group_size
        return 1 if engine.block is None else dim // engine.block

    def _scale_bytes(self, meta_dtype: str, fmt: str) -> int:
        engine = ENGINE_FORMATS.get(fmt)
        return META_DTYPE_BYTES[meta_dtype] if engine is None else engine.scale_bytes

    def _meta(self, dim: int, bits: int, meta_dtype: str, fmt: str = "int") -> int:
        """Per group: the scale, and a UINT8 zero point for integer codes (FP8 has none); an
        engine format's own blocks and scale bytes."""
        if bits >= UNQUANTIZED_BITS:
            return 0
        zero = ZERO_POINT_BYTES if fmt == "int" else 0
        return self._groups(dim, fmt) * (self._scale_bytes(meta_dtype, fmt) + zero)

    def metadata_bytes(self) -> int:
        """Both paths' metadata; padded to 8 B in our page layout, as the engine lays it otherwise."""
        s = self.spec
        raw = self._meta(self.d_c, s.content_bits, s.content_meta_dtype, s.content_format)
        raw += self._meta(self.d_r, s.rope_bits, s.rope_meta_dtype, s.rope_format)
        return raw if s.engine else math.ceil(raw / 8) * 8

    def token_bytes(self) -> int:
        s = self.spec
        return (
            self._codes(self.d_c, s.content_bits)
            + self._codes(self.d_r, s.rope_bits)
            + self.metadata_bytes()
        )

    def page_bytes(self) -> int:
        return self.page_tokens * self.token_bytes()

    def sections(self) -> dict[str, tuple[int, int]]:
        """Where each array lives inside a page: name -> (byte offset, bytes), structure of arrays
        (all 64 tokens' content codes, then RoPE codes, then each metadata array), so a kernel
        loads each kind contiguously. The sections tile the page exactly (the tail is padding)."""
        s, t = self.spec, self.page_tokens
        arrays = [
            ("content_codes", t * self._codes(self.d_c, s.content_bits)),
            ("rope_codes", t * self._codes(self.d_r, s.rope_bits)),
        ]
        for path, dim, bits, meta, fmt in (
            ("content", self.d_c, s.content_bits, s.content_meta_dtype, s.content_format),
            ("rope", self.d_r, s.rope_bits, s.rope_meta_dtype, s.rope_format),
        ):
            if bits < UNQUANTIZED_BITS:
                groups = self._groups(dim, fmt)
                arrays.append((f"{path}_scales", t * groups * self._scale_bytes(meta, fmt)))
                if fmt == "int":
                    arrays.append((f"{path}_zeros", t * groups * ZERO_POINT_BYTES))
        out, offset = {}, 0
        for name, size in arrays:
            out[name] = (offset, size)
            offset += size
        out["padding"] = (offset, self.page_bytes() - offset)
        return out

    def protection_bytes(self) -> int:
        return (
            (self.sink + self.recent) * (self.d_c + self.d_r) * BF16_BYTES if self.quantized else 0
        )

    def persistent_bytes(self, tokens: int) -> int:
        """Per layer and request: pages (+ their reverse-map entries when packed) + BF16 protection buffer."""
        pages = math.ceil(tokens / self.page_tokens)
        per_page = self.page_bytes() + (PAGE_MAP_BYTES if self.quantized else 0)
        return pages * per_page + self.protection_bytes()


def layout(precision: str, d_c: int = 512, d_r: int = 64, **fields) -> CacheLayout:
    """The layout of `precision` ('c4r4', ...); the paper's dims by default."""
    protection = {k: fields.pop(k) for k in ("sink", "recent", "page_tokens") if k in fields}
    return CacheLayout(QuantizerSpec.from_precision(precision, **fields), d_c, d_r, **protection)


LAYOUTS = {name: layout(name) for name in ("bf16", "c4r4", "c2r4", "c4r16")}
# vLLM's `fp8_ds_mla`: an E4M3 latent with an FP32 scale per 128 elements, a BF16 RoPE key (656 B).
LAYOUTS["fp8_ds_mla"] = layout("ce4m3r16", group_size=128, content_meta_dtype="float32")
# The formats production engines ship for MLA (576 B, 352 B, 306 B, 386 B at 512 + 64), by name.
ENGINE_PRECISIONS = {
    "fp8": "ce4m3tre4m3t",  # vLLM `fp8`: both paths E4M3 at a static tensor scale
    "nvfp4_ds_mla": "cnvfp4re4m3t",  # NVFP4 latent, FP8 RoPE key
    "mxfp4": "cmxfp4rmxfp4",
    "turboquant4": "clm4r16",  # rotated Lloyd-Max latent (4 bits + a BF16 norm), BF16 RoPE key
}
LAYOUTS.update({name: layout(p) for name, p in ENGINE_PRECISIONS.items()})


def compression(precision: str, tokens: int) -> float:
    return LAYOUTS["bf16"].persistent_bytes(tokens) / LAYOUTS[precision].persistent_bytes(tokens)
