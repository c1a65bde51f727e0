"""The quantizer spec (pure data, no torch): bit widths per path, group size, metadata dtypes.

One frozen object read by the simulator, calibration, artifacts and the memory model; the math
lives in `quantmla.quant`. Importing this module is instant, so config errors answer at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantmla.errors import ConfigError

UNQUANTIZED_BITS = 16  # a path at 16 bits is stored as BF16, not quantized
# Metadata dtypes a cache may store scales/zeros in, with their size in bytes.
META_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_META_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_PRECISION_RE = re.compile(r"c(\d+)r(\d+)")
# The fields besides the precision that fix a spec (a policy or serving config carries them too).
SPEC_FIELDS = ("group_size", "content_meta_dtype", "rope_meta_dtype")
PRECISION_ALLOWED = "'bf16' or 'c<x>r<y>' with x, y in 1..8 or 16 (e.g. c4r4, c2r4, c4r16)"


def parse_precision(precision: str) -> tuple[int, int]:
    """(content bits, RoPE bits) of 'bf16' or 'c<x>r<y>' (16 = that path unquantized)."""
    if precision == "bf16":
        return UNQUANTIZED_BITS, UNQUANTIZED_BITS
    match = _PRECISION_RE.fullmatch(str(precision))
    bits = tuple(int(g) for g in match.groups()) if match else ()
    if not bits or any(not (1 <= b <= 8 or b == UNQUANTIZED_BITS) for b in bits):
        raise ConfigError("precision", precision, PRECISION_ALLOWED)
    return bits


@dataclass(frozen=True)
class QuantizerSpec:
    """Everything that fixes the cached codes of both paths: bit widths, group size, metadata dtypes.

    The simulator, calibration, artifacts and the memory model all read this one object; `key` is
    its string form (the artifact's quantizer field)."""

    content_bits: int
    rope_bits: int
    group_size: int = 64
    content_meta_dtype: str = "bfloat16"  # stored scale/zero dtype of the content latent
    rope_meta_dtype: str = "float32"  # ... of the RoPE key

    def __post_init__(self):
        for name in ("content_bits", "rope_bits"):
            bits = getattr(self, name)
            if bits != UNQUANTIZED_BITS:
                check_bits(bits, name)
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ConfigError("group_size", g, "a positive integer dividing d_c and d_r")
        for name in ("content_meta_dtype", "rope_meta_dtype"):
            if getattr(self, name) not in META_DTYPE_BYTES:
                raise ConfigError(name, getattr(self, name), tuple(META_DTYPE_BYTES))

    @classmethod
    def from_precision(cls, precision: str, **fields) -> QuantizerSpec:
        return cls(*parse_precision(precision), **fields)

    @property
    def quantized(self) -> bool:
        return self.content_bits < UNQUANTIZED_BITS or self.rope_bits < UNQUANTIZED_BITS

    @property
    def precision(self) -> str:
        return f"c{self.content_bits}r{self.rope_bits}" if self.quantized else "bf16"

    @property
    def key(self) -> str:
        """e.g. 'c4r4-asym-pertoken-g64-rne-content_bf16-rope_fp32'."""
        return (
            f"{self.precision}-asym-pertoken-g{self.group_size}-rne"
            f"-content_{_META_SHORT[self.content_meta_dtype]}-rope_{_META_SHORT[self.rope_meta_dtype]}"
        )

    def check_dims(self, d_c: int, d_r: int) -> None:
        """The group size must divide both cached widths (only when something is quantized)."""
        if not self.quantized:
            return
        for name, dim in (("d_c", d_c), ("d_r", d_r)):
            if dim % self.group_size:
                raise ConfigError(
                    "group_size",
                    self.group_size,
                    f"a divisor of {name}={dim} (and of the other path)",
                )


def check_bits(bits: int, field: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(field, bits, "an integer in 1..8")
    return bits
