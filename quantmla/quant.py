"""The quantizer (docs/method.md §2): per-token asymmetric affine, groups of `group_size` along the last axis.

For a group x and b bits: m = 2^b - 1, lo = min(min x, 0), hi = max(max x, 0), s = (hi - lo)/m,
z = round(-lo / s), q = clamp(round(x/s) + z, 0, m), x̂ = (q - z)·s, round-half-to-even.

Choice (zero in range): the range always includes 0, so z ∈ [0, m] is an exact integer that the
packed cache stores in one byte (the paper's 320 B/token) and that every metadata dtype holds
exactly. For a group that straddles 0 — every group of a real latent we measured — this is SPEC
§2's quantizer bit for bit; a group of one sign (e.g. a constant one) is quantized on [0, max] or
[min, 0] instead of [min, max].
This module is the only place the math lives: fake-quant evaluation, calibration (STE) and the
packed cache all call it.

Choice (constant groups): s is floored at `SCALE_FLOOR` (1e-8), so an all-zero group gets s = 1e-8,
z = 0, q = 0 and reconstructs to exactly 0; a constant c ≠ 0 gets s = |c|/m and reconstructs to c
within the metadata dtype's rounding, never NaN/Inf.
Metadata (s, z) is rounded to `meta_dtype` before dequantization, as the packed cache stores it:
BF16 for the content latent, FP32 for the RoPE key.
Non-finite input stays inside its own group: a NaN/Inf in one group never changes another group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.spec import ENGINE_FORMATS, FP8_FORMATS, UNQUANTIZED_BITS, QuantizerSpec, check_bits

SCALE_FLOOR = 1e-8
# codes pack little-end first into words of lcm(bits, 8) bits (one byte, or three for 3 and 6 bits)
PACKABLE_BITS = (1, 2, 3, 4, 6, 8)
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # largest finite value of each format


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or x.shape[-1] % group_size:
        raise ConfigError(
            "group_size", group_size, f"a positive divisor of the last dimension ({x.shape[-1]})"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def round_ste(v: torch.Tensor) -> torch.Tensor:
    """Round-half-to-even forward, identity backward (straight-through estimator)."""
    return v + (torch.round(v) - v).detach()


@dataclass
class Quantized:
    """Integer codes (uint8, one per element, grouped shape (..., n_groups, g)) plus per-group metadata."""

    codes: torch.Tensor
    scale: torch.Tensor  # (..., n_groups, 1), meta dtype
    zero: torch.Tensor  # (..., n_groups, 1), meta dtype
    bits: int


def _codes(x: torch.Tensor, bits: int, group_size: int, meta_dtype: torch.dtype | None, ste: bool):
    """Grouped float codes (not yet cast), scale and zero; at least float32 math (float64 stays float64)."""
    check_bits(bits)
    xg = _grouped(x.to(torch.promote_types(x.dtype, torch.float32)), group_size)
    levels = 2**bits - 1
    lo = xg.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = xg.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / levels).clamp_min(SCALE_FLOOR)
    rnd = round_ste if ste else torch.round
    zero = rnd(-lo / scale)
    if meta_dtype is not None:
        # The stored metadata's precision; differentiable casts keep STE gradients flowing.
        scale, zero = scale.to(meta_dtype).to(xg.dtype), zero.to(meta_dtype).to(xg.dtype)
    codes = torch.clamp(rnd(xg / scale) + zero, 0, levels)
    return codes, scale, zero


def quantize(
    x: torch.Tensor, bits: int, group_size: int = 64, meta_dtype: torch.dtype | None = None
) -> Quantized:
    """Codes and metadata of `x` (last axis grouped), computed in at least float32."""
    codes, scale, zero = _codes(x, bits, group_size, meta_dtype, ste=False)
    store = meta_dtype or torch.float32
    return Quantized(codes.to(torch.uint8), scale.to(store), zero.to(store), bits)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = (q - z)·s, back to the ungrouped shape."""
    out = (q.codes.float() - q.zero.float()) * q.scale.float()
    return out.flatten(-2).to(dtype)


def quantize_dequantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = 64,
    meta_dtype: torch.dtype | None = None,
    ste: bool = False,
) -> torch.Tensor:
    """Fake-quantize `x` (any leading shape, last axis grouped); returns x's dtype.

    `ste=True` uses the straight-through estimator on rounding only, so gradients reach x through
    x/s and through s and z (calibration). `meta_dtype` rounds s and z as the packed cache stores them.
    """
    codes, scale, zero = _codes(x, bits, group_size, meta_dtype, ste)
    return ((codes - zero) * scale).flatten(-2).to(x.dtype)


def pack_word(bits: int) -> tuple[int, int]:
    """(bytes, codes) of one packed word: lcm(bits, 8) bits, e.g. 3-bit codes 8 to 3 bytes."""
    if bits not in PACKABLE_BITS:
        raise ConfigError("pack bits", bits, PACKABLE_BITS)
    word_bytes = math.lcm(bits, 8) // 8
    return word_bytes, 8 * word_bytes // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (< 2^bits) along the last axis into uint8: code j of a word at bit
    j·bits, the word's bytes little-endian (`pack_word`)."""
    word_bytes, per_word = pack_word(bits)
    if codes.shape[-1] % per_word:
        raise ConfigError("pack last dimension", codes.shape[-1], f"a multiple of {per_word}")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, per_word)
    shifts = torch.arange(0, 8 * word_bytes, bits, dtype=torch.int32, device=codes.device)
    word = (c << shifts).sum(dim=-1, dtype=torch.int32)
    to_bytes = torch.arange(0, 8 * word_bytes, 8, dtype=torch.int32, device=codes.device)
    return ((word.unsqueeze(-1) >> to_bytes) & 0xFF).to(torch.uint8).flatten(-2)


def packed_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The packed words along the last axis, each from its little-endian bytes: the bytes
    themselves (uint8) where a word is one byte, else int32."""
    word_bytes, _ = pack_word(bits)
    if word_bytes == 1:
        return packed
    b = packed.reshape(*packed.shape[:-1], -1, word_bytes).to(torch.int32)
    word = b[..., 0]
    for k in range(1, word_bytes):
        word = word | b[..., k] << (8 * k)
    return word


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: uint8 codes, the last axis 8/bits times longer."""
    word = packed_words(packed, bits)
    _, per_word = pack_word(bits)
    shifts = torch.arange(0, per_word * bits, bits, dtype=word.dtype, device=packed.device)
    return ((word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).flatten(-2)


def fp8_round(v: torch.Tensor, fmt: str, ste: bool = False) -> torch.Tensor:
    """v rounded to the nearest value of FP8 format `fmt` (ties to even, subnormals kept),
    saturating at ±max; float32 out. NaN is refused (it has no code to stand for)."""
    if fmt not in FP8_FORMATS:
        raise ConfigError("fp8 format", fmt, tuple(FP8_FORMATS))
    if bool(torch.isnan(v).any()):
        raise NonFiniteCacheError(f"NaN reached the {fmt} quantizer; nothing was rounded")
    top = FP8_MAX[fmt]
    v = v.float().clamp(-top, top)
    rounded = v.to(FP8_DTYPES[fmt]).float()
    return v + (rounded - v).detach() if ste else rounded


def fp8_quantize_dequantize(
    x: torch.Tensor,
    fmt: str,
    group_size: int = 64,
    meta_dtype: torch.dtype | None = None,
    ste: bool = False,
) -> torch.Tensor:
    """FP8 fake-quant per token and group: s = max|x| / FP8_MAX (floored at SCALE_FLOOR, rounded
    to `meta_dtype` as stored), x̂ = round_fmt(x / s) · s; no zero point. Returns x's dtype."""
    xg = _grouped(x.to(torch.promote_types(x.dtype, torch.float32)), group_size)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX[fmt]).clamp_min(SCALE_FLOOR)
    if meta_dtype is not None:
        scale = scale.to(meta_dtype).to(xg.dtype)
    return (fp8_round(xg / scale, fmt, ste).to(xg.dtype) * scale).flatten(-2).to(x.dtype)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4's non-negative values
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def e2m1_round(v: torch.Tensor, ste: bool = False) -> torch.Tensor:
    """v rounded to the nearest E2M1 value (ties to the even mantissa, as IEEE), saturating at ±6."""
    grid = torch.tensor(E2M1_VALUES, dtype=v.dtype, device=v.device)
    a = v.abs().clamp(max=E2M1_MAX)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(max=len(E2M1_VALUES) - 2)
    below, above = grid[lo], grid[lo + 1]
    up = (above - a < a - below) | ((above - a == a - below) & ((lo + 1) % 2 == 0))
    rounded = torch.where(up, above, below).copysign(v)
    return v + (rounded - v).detach() if ste else rounded


def nvfp4_quantize_dequantize(x: torch.Tensor, ste: bool = False) -> torch.Tensor:
    """NVFP4 per token: blocks of 16, scale max|x|/6 rounded to E4M3 (tensor scale 1.0, so a
    block below E4M3's range keeps its smallest subnormal), E2M1 values."""
    xg = _grouped(x.to(torch.promote_types(x.dtype, torch.float32)), 16)
    scale = fp8_round(xg.abs().amax(dim=-1, keepdim=True) / E2M1_MAX, "e4m3", ste)
    scale = scale.to(xg.dtype).clamp_min(E4M3_MIN_SUBNORMAL)
    return (e2m1_round(xg / scale, ste) * scale).flatten(-2).to(x.dtype)


def mxfp4_quantize_dequantize(x: torch.Tensor, ste: bool = False) -> torch.Tensor:
    """MXFP4 (OCP MX v1.0) per token: blocks of 32 share 2^(floor(log2 max|x|) − 2) (E8M0; E2M1's
    largest exponent is 2), E2M1 values saturating at ±6."""
    xg = _grouped(x.to(torch.promote_types(x.dtype, torch.float32)), 32)
    amax = xg.abs().amax(dim=-1, keepdim=True).detach()
    exponent = torch.floor(torch.log2(amax.clamp_min(2.0**-127))) - 2
    scale = torch.exp2(exponent.clamp(-127, 127))
    return (e2m1_round(xg / scale, ste) * scale).flatten(-2).to(x.dtype)


@cache
def gaussian_lloyd_max(levels: int = 16, iterations: int = 500) -> tuple[float, ...]:
    """The MSE-optimal `levels`-point scalar quantizer of N(0, 1) (Lloyd's algorithm on the exact
    density: each level the centroid of its cell, each boundary the midpoint of its levels)."""
    pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    points = [-3 + 6 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(iterations):
        edges = [-math.inf, *((a + b) / 2 for a, b in zip(points, points[1:])), math.inf]
        points = [
            (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])
        ]  # fmt: skip
    return tuple(points)


@cache
def hadamard_rotation(dim: int, seed: int = 0) -> torch.Tensor:
    """H_dim · diag(±1) / √dim (float64): Sylvester's Hadamard matrix with fixed random signs,
    orthogonal; `dim` a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ConfigError("hadamard dimension", dim, "a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return h * signs.double() / math.sqrt(dim)


def lloyd_max_quantize_dequantize(x: torch.Tensor, ste: bool = False) -> torch.Tensor:
    """TurboQuant's MSE quantizer, 4 bits: rotate the token's vector by `hadamard_rotation`, scale
    its coordinates by √d / ‖x‖ (the norm stored in BF16) to ~N(0, 1), round each to the nearest
    `gaussian_lloyd_max` level, undo both."""
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    d = work.shape[-1]
    rot = hadamard_rotation(d).to(work.device, work.dtype)
    norm = work.norm(dim=-1, keepdim=True).to(torch.bfloat16).to(work.dtype).clamp_min(SCALE_FLOOR)
    u = (work @ rot.T) * (math.sqrt(d) / norm)
    levels = torch.tensor(gaussian_lloyd_max(16), dtype=work.dtype, device=work.device)
    cells = torch.bucketize(u.detach(), (levels[1:] + levels[:-1]) / 2)
    rounded = levels[cells]
    u = u + (rounded - u).detach() if ste else rounded
    return ((u * (norm / math.sqrt(d))) @ rot).to(x.dtype)


ENGINE_QDQ = {
    "e4m3t": lambda x, ste: fp8_round(x, "e4m3", ste).to(x.dtype),
    "nvfp4": nvfp4_quantize_dequantize,
    "mxfp4": mxfp4_quantize_dequantize,
    "lm4": lloyd_max_quantize_dequantize,
}
assert set(ENGINE_QDQ) == set(ENGINE_FORMATS)


def qdq_content(spec: QuantizerSpec, x: torch.Tensor, ste: bool = False) -> torch.Tensor:
    """Fake-quantize the content latent as the cache stores it (identity at 16 bits)."""
    return _qdq_path(
        x, spec.content_bits, spec.content_format, spec.group_size, spec.content_meta_dtype, ste
    )


def qdq_rope(spec: QuantizerSpec, x: torch.Tensor, ste: bool = False) -> torch.Tensor:
    """Fake-quantize the RoPE key as the cache stores it (identity at 16 bits)."""
    return _qdq_path(
        x, spec.rope_bits, spec.rope_format, spec.group_size, spec.rope_meta_dtype, ste
    )


def _qdq_path(x, bits: int, fmt: str, group_size: int, meta: str, ste: bool) -> torch.Tensor:
    if bits >= UNQUANTIZED_BITS:
        return x
    meta_dtype = getattr(torch, meta)
    if fmt in ENGINE_QDQ:
        return ENGINE_QDQ[fmt](x, ste)
    if fmt != "int":
        return fp8_quantize_dequantize(x, fmt, group_size, meta_dtype, ste)
    return quantize_dequantize(x, bits, group_size, meta_dtype=meta_dtype, ste=ste)
