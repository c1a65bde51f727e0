"""The quantizer spec (pure data, no torch): bit widths per path, group size, metadata dtypes.

One frozen object read by the simulator, calibration, artifacts and the memory model; the math
lives in `quantmla.quant`. Importing this module is instant, so config errors answer at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from quantmla.errors import ConfigError

UNQUANTIZED_BITS = 16  # a path at 16 bits is stored as BF16, not quantized
# Floating-point 8-bit formats a path may use instead of integer codes: (exponent, mantissa) bits.
FP8_FORMATS = {"e4m3": (4, 3), "e5m2": (5, 2)}
FORMATS = ("int", *FP8_FORMATS)
# Metadata dtypes a cache may store scales/zeros in, with their size in bytes.
META_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_META_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_PRECISION_RE = re.compile(r"c(\d+|e4m3|e5m2)r(\d+|e4m3|e5m2)")
# The fields besides the precision that fix a spec (a policy or serving config carries them too).
SPEC_FIELDS = ("group_size", "content_meta_dtype", "rope_meta_dtype")
PRECISION_ALLOWED = (
    "'bf16' or 'c<x>r<y>' with x, y in 1..8 (integer bits), 16 (BF16) or e4m3 / e5m2 (FP8) "
    "(e.g. c4r4, c2r4, c4r16, ce4m3r16)"
)


def parse_formats(precision: str) -> tuple[tuple[int, str], tuple[int, str]]:
    """((bits, format), (bits, format)) of the content and RoPE paths: 'bf16' or 'c<x>r<y>';
    an FP8 token (e4m3, e5m2) is 8 bits of that format, a number that many integer bits."""
    if precision == "bf16":
        return (UNQUANTIZED_BITS, "int"), (UNQUANTIZED_BITS, "int")
    match = _PRECISION_RE.fullmatch(str(precision))
    if not match:
        raise ConfigError("precision", precision, PRECISION_ALLOWED)
    paths = tuple((8, g) if g in FP8_FORMATS else (int(g), "int") for g in match.groups())
    if any(not (1 <= b <= 8 or b == UNQUANTIZED_BITS) for b, _ in paths):
        raise ConfigError("precision", precision, PRECISION_ALLOWED)
    return paths


def parse_precision(precision: str) -> tuple[int, int]:
    """(content bits, RoPE bits) of a precision (16 = that path unquantized)."""
    (content, _), (rope, _) = parse_formats(precision)
    return content, rope


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
    content_format: str = "int"  # int: asymmetric integer codes; e4m3 / e5m2: FP8, absmax scale
    rope_format: str = "int"

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
        for name, bits in (("content_format", self.content_bits), ("rope_format", self.rope_bits)):
            fmt = getattr(self, name)
            if fmt not in FORMATS:
                raise ConfigError(name, fmt, FORMATS)
            if fmt != "int" and bits != 8:
                raise ConfigError(f"{name.split('_')[0]}_bits ({fmt})", bits, "8 for an FP8 format")

    @classmethod
    def from_precision(cls, precision: str, **fields) -> QuantizerSpec:
        (c_bits, c_fmt), (r_bits, r_fmt) = parse_formats(precision)
        return cls(c_bits, r_bits, content_format=c_fmt, rope_format=r_fmt, **fields)

    @property
    def fp8(self) -> bool:
        return self.content_format != "int" or self.rope_format != "int"

    @property
    def quantized(self) -> bool:
        return self.content_bits < UNQUANTIZED_BITS or self.rope_bits < UNQUANTIZED_BITS

    @property
    def precision(self) -> str:
        if not self.quantized:
            return "bf16"
        c = self.content_format if self.content_format != "int" else self.content_bits
        r = self.rope_format if self.rope_format != "int" else self.rope_bits
        return f"c{c}r{r}"

    @property
    def key(self) -> str:
        """e.g. 'c4r4-asym-pertoken-g64-rne-content_bf16-rope_fp32' ('asym+fp8' with an FP8 path:
        its groups have an absmax scale and no zero point)."""
        scheme = "asym+fp8" if self.fp8 else "asym"
        return (
            f"{self.precision}-{scheme}-pertoken-g{self.group_size}-rne"
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


def layer_spec(specs: QuantizerSpec | Sequence[QuantizerSpec], layer: int) -> QuantizerSpec:
    """Layer `layer`'s spec: one spec for every layer, or one per layer (a mixed allocation)."""
    return specs if isinstance(specs, QuantizerSpec) else specs[layer]


def check_bits(bits: int, field: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ConfigError(field, bits, "an integer in 1..8")
    return bits
