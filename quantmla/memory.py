"""Persistent KV-cache memory of the paged, packed MLA cache (SPEC §6; paper Fig. 5a, App. C.5).

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

BF16_BYTES = 2
PAGE_TOKENS = 64
PAGE_MAP_BYTES = 8  # reverse page map entry per physical page


@dataclass(frozen=True)
class CacheLayout:
    content_bits: int  # 16 = BF16
    rope_bits: int
    d_c: int = 512
    d_r: int = 64
    group_size: int = 64
    sink: int = 4
    recent: int = 128

    @property
    def quantized(self) -> bool:
        return self.content_bits < 16 or self.rope_bits < 16

    def _codes(self, dim: int, bits: int) -> int:
        return dim * BF16_BYTES if bits >= 16 else dim * bits // 8

    def metadata_bytes(self) -> int:
        content = (self.d_c // self.group_size) * (2 + 1) if self.content_bits < 16 else 0
        rope = (self.d_r // self.group_size) * (4 + 1) if self.rope_bits < 16 else 0
        return math.ceil((content + rope) / 8) * 8

    def token_bytes(self) -> int:
        return (
            self._codes(self.d_c, self.content_bits)
            + self._codes(self.d_r, self.rope_bits)
            + self.metadata_bytes()
        )

    def page_bytes(self) -> int:
        return PAGE_TOKENS * self.token_bytes()

    def protection_bytes(self) -> int:
        return (
            (self.sink + self.recent) * (self.d_c + self.d_r) * BF16_BYTES if self.quantized else 0
        )

    def persistent_bytes(self, tokens: int) -> int:
        """Per layer and request: pages (+ their reverse-map entries when packed) + BF16 protection buffer."""
        pages = math.ceil(tokens / PAGE_TOKENS)
        per_page = self.page_bytes() + (PAGE_MAP_BYTES if self.quantized else 0)
        return pages * per_page + self.protection_bytes()


LAYOUTS = {
    "bf16": CacheLayout(16, 16),
    "c4r4": CacheLayout(4, 4),
    "c2r4": CacheLayout(2, 4),
    "c4r16": CacheLayout(4, 16),
}


def compression(precision: str, tokens: int) -> float:
    return LAYOUTS["bf16"].persistent_bytes(tokens) / LAYOUTS[precision].persistent_bytes(tokens)
