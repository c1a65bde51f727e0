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
PATHS = ("content", "rope")  # the cache's two paths: the latent c and the RoPE key k_R
# the packed cache's op implementations: auto = Triton on CUDA, torch / C++ elsewhere
KERNELS = ("auto", "torch", "triton")
# Floating-point 8-bit formats a path may use instead of integer codes: (exponent, mantissa) bits.
FP8_FORMATS = {"e4m3": (4, 3), "e5m2": (5, 2)}


@dataclass(frozen=True)
class EngineFormat:
    """A cache format production engines ship, with its own blocks and scale encoding (the spec's
    group size and metadata dtypes do not apply): `block` elements share `scale_bytes` of scale
    (block None: the whole path vector of a token). `fixed_range`: no scale follows the values'
    magnitude (a tensor scale fixed at 1.0), so their codes cover a fixed window of magnitudes
    (E4M3's, with its subnormal floor) and a transform must keep the path at the model's own."""

    bits: int
    block: int | None
    scale_bytes: int
    what: str
    fixed_range: bool = False


ENGINE_FORMATS = {
    "e4m3t": EngineFormat(
        8, None, 0, "FP8 E4M3, static tensor scale 1.0 (vLLM `fp8` by default)", fixed_range=True
    ),
    "nvfp4": EngineFormat(
        4, 16, 1, "E2M1 values, an E4M3 scale per 16, tensor scale 1.0", fixed_range=True
    ),
    "mxfp4": EngineFormat(4, 32, 1, "E2M1 values, an E8M0 (power of two) scale per 32"),
    "lm4": EngineFormat(
        4,
        None,
        2,
        "randomized Hadamard rotation, 16-level Gaussian Lloyd-Max codebook on "
        "coordinates scaled by the vector's norm (BF16)",
    ),  # fmt: skip
}
FORMATS = ("int", *FP8_FORMATS, *ENGINE_FORMATS)
_TOKENS = "|".join(sorted((*FP8_FORMATS, *ENGINE_FORMATS), key=len, reverse=True))
# Metadata dtypes a cache may store scales/zeros in, with their size in bytes.
META_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_META_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_PRECISION_RE = re.compile(rf"c(\d+|{_TOKENS})r(\d+|{_TOKENS})")
# The fields besides the precision that fix a spec (a policy or serving config carries them too).
SPEC_FIELDS = ("group_size", "content_meta_dtype", "rope_meta_dtype")
PRECISION_ALLOWED = (
    "'bf16' or 'c<x>r<y>' with x, y in 1..8 (integer bits), 16 (BF16), e4m3 / e5m2 (FP8, a "
    "scale per group) or an engine format: e4m3t, nvfp4, mxfp4, lm4 "
    "(e.g. c4r4, c2r4, c4r16, ce4m3r16, cnvfp4re4m3t)"
)


def parse_formats(precision: str) -> tuple[tuple[int, str], tuple[int, str]]:
    """((bits, format), (bits, format)) of the content and RoPE paths: 'bf16' or 'c<x>r<y>';
    a format token (e4m3, nvfp4, ...) is that format at its bits, a number that many integer bits."""
    if precision == "bf16":
        return (UNQUANTIZED_BITS, "int"), (UNQUANTIZED_BITS, "int")
    match = _PRECISION_RE.fullmatch(str(precision))
    if not match:
        raise ConfigError("precision", precision, PRECISION_ALLOWED)
    paths = tuple(_path_format(g) for g in match.groups())
    if any(not (1 <= b <= 8 or b == UNQUANTIZED_BITS) for b, _ in paths):
        raise ConfigError("precision", precision, PRECISION_ALLOWED)
    return paths


def _path_format(token: str) -> tuple[int, str]:
    if token in FP8_FORMATS:
        return 8, token
    if token in ENGINE_FORMATS:
        return ENGINE_FORMATS[token].bits, token
    return int(token), "int"


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
            if fmt in FP8_FORMATS and bits != 8:
                raise ConfigError(f"{name.split('_')[0]}_bits ({fmt})", bits, "8 for an FP8 format")
            if fmt in ENGINE_FORMATS and bits != ENGINE_FORMATS[fmt].bits:
                raise ConfigError(
                    f"{name.split('_')[0]}_bits ({fmt})", bits, ENGINE_FORMATS[fmt].bits
                )

    @classmethod
    def from_precision(cls, precision: str, **fields) -> QuantizerSpec:
        (c_bits, c_fmt), (r_bits, r_fmt) = parse_formats(precision)
        return cls(c_bits, r_bits, content_format=c_fmt, rope_format=r_fmt, **fields)

    @property
    def fp8(self) -> bool:
        return self.content_format != "int" or self.rope_format != "int"

    @property
    def packable(self) -> bool:
        """Every quantized path in integer codes: what the packed cache and its kernels hold."""
        return not self.fp8

    def path_format(self, path: str) -> tuple[int, str]:
        """(bits, format) of 'content' or 'rope'."""
        if path == "content":
            return self.content_bits, self.content_format
        return self.rope_bits, self.rope_format

    def fixed_range(self, path: str) -> bool:
        """Whether `path` ('content' or 'rope') is quantized in a format whose codes cover a
        fixed window of magnitudes (`EngineFormat.fixed_range`): its transform sets its scale."""
        bits, fmt = self.path_format(path)
        engine = ENGINE_FORMATS.get(fmt)
        return bits < UNQUANTIZED_BITS and engine is not None and engine.fixed_range

    @property
    def engine(self) -> bool:
        """A path in an engine format (bytes as that engine lays them out, no padding of ours)."""
        return self.content_format in ENGINE_FORMATS or self.rope_format in ENGINE_FORMATS

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
        named = {"fp8" if f in FP8_FORMATS else f for f in (self.content_format, self.rope_format)}
        scheme = "+".join(["asym", *sorted(named - {"int"})])
        return (
            f"{self.precision}-{scheme}-pertoken-g{self.group_size}-rne"
            f"-content_{_META_SHORT[self.content_meta_dtype]}-rope_{_META_SHORT[self.rope_meta_dtype]}"
        )

    @classmethod
    def from_key(cls, key: str) -> QuantizerSpec:
        """The spec whose `key` this is (an artifact's quantizer field read back)."""
        parts = key.split("-")
        try:
            precision, group = parts[0], int(parts[3].removeprefix("g"))
            short = {v: k for k, v in _META_SHORT.items()}
            content_meta = short[parts[5].removeprefix("content_")]
            rope_meta = short[parts[6].removeprefix("rope_")]
        except (IndexError, KeyError, ValueError):
            raise ConfigError("quantizer", key, "a QuantizerSpec.key") from None
        spec = cls.from_precision(
            precision, group_size=group, content_meta_dtype=content_meta, rope_meta_dtype=rope_meta
        )
        if spec.key != key:
            raise ConfigError("quantizer", key, "a QuantizerSpec.key")
        return spec

    def path_key(self, path: str) -> str | None:
        """What fixes one path's codes ('content' or 'rope'; None where it is not quantized): its
        format and bits, and for group formats the group size and metadata dtype."""
        bits, fmt = self.path_format(path)
        if bits >= UNQUANTIZED_BITS:
            return None
        if fmt in ENGINE_FORMATS:
            return f"{path}:{fmt}"
        meta = self.content_meta_dtype if path == "content" else self.rope_meta_dtype
        codes = fmt if fmt in FP8_FORMATS else f"int{bits}"
        return f"{path}:{codes}-g{self.group_size}-{meta}"

    def check_dims(self, d_c: int, d_r: int) -> None:
        """The group size must divide every quantized path grouped by it; an engine format's own
        block must divide its path (`lm4`'s Hadamard rotation needs a power-of-two width)."""
        paths = (
            ("d_c", d_c, self.content_bits, self.content_format),
            ("d_r", d_r, self.rope_bits, self.rope_format),
        )
        for name, dim, bits, fmt in paths:
            engine = ENGINE_FORMATS.get(fmt)
            if bits >= UNQUANTIZED_BITS or (engine is not None and engine.block is None):
                if fmt == "lm4" and dim & (dim - 1):
                    raise ConfigError(
                        f"precision ({fmt})", self.precision, f"a power-of-two {name} (got {dim})"
                    )
                continue
            if engine is not None and dim % engine.block:
                raise ConfigError(
                    f"precision ({fmt})",
                    self.precision,
                    f"{name}={dim} divisible by {engine.block}",
                )
            if engine is None and dim % self.group_size:
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
