"""FP8 paths of the one quantizer (E4M3 / E5M2 with an absmax scale per group) against a float64
reference built from the formats' definitions, and their bytes in the memory model."""

import itertools

import numpy as np
import pytest
import torch

from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.memory import LAYOUTS, layout
from quantmla.quant import FP8_MAX, fp8_quantize_dequantize, fp8_round, qdq_content, qdq_rope
from quantmla.spec import QuantizerSpec


def representable(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Every non-negative finite value of the format (float64) and its mantissa's last bit, from
    the definition: bias 2^(e−1) − 1, subnormals at exponent 0; E4M3 ("fn") keeps exponent 15 for
    normals except mantissa 7 (NaN), E5M2 reserves exponent 31 (inf/NaN)."""
    e_bits, m_bits = {"e4m3": (4, 3), "e5m2": (5, 2)}[fmt]
    bias = 2 ** (e_bits - 1) - 1
    values, odd = [], []
    for e, m in itertools.product(range(2**e_bits), range(2**m_bits)):
        if fmt == "e5m2" and e == 2**e_bits - 1:
            continue
        if fmt == "e4m3" and e == 2**e_bits - 1 and m == 2**m_bits - 1:
            continue
        v = (
            (m / 2**m_bits) * 2.0 ** (1 - bias)
            if e == 0
            else (1 + m / 2**m_bits) * 2.0 ** (e - bias)
        )
        values.append(v)
        odd.append(m & 1)
    order = np.argsort(values)
    return np.array(values)[order], np.array(odd)[order]


def reference_round(v: np.ndarray, fmt: str) -> np.ndarray:
    """Nearest representable value, ties to the even mantissa, saturating at ±max (float64)."""
    grid, odd = representable(fmt)
    a = np.minimum(np.abs(v), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(odd[lo] == 0, lo, hi)))
    return np.sign(v) * grid[pick]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_equals_the_float64_reference(fmt):
    grid, _ = representable(fmt)
    assert grid[-1] == FP8_MAX[fmt]
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbours
    rng = np.random.default_rng(0)
    v = np.concatenate([
        grid, -grid, mids, -mids,
        rng.uniform(-1, 1, 4000) * grid[-1],  # normal range
        rng.uniform(-1, 1, 2000) * grid[8],  # subnormal range
        [grid[-1] * 1.01, -grid[-1] * 5, 1e30, -np.inf, np.inf],  # saturation
    ])  # fmt: skip
    v32 = v.astype(np.float32)  # the quantizer sees float32 inputs
    got = fp8_round(torch.from_numpy(v32), fmt).double().numpy()
    np.testing.assert_array_equal(got, reference_round(v32.astype(np.float64), fmt))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_group_quantizer_equals_the_reference_with_its_stored_scale(fmt):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 256, generator=gen) * torch.logspace(-4, 2, 256)
    x[0, :128] = 0.0  # an all-zero group: scale floored, reconstructs to 0
    got = fp8_quantize_dequantize(x, fmt, 128, meta_dtype=torch.float32)
    g = x.double().numpy().reshape(6, 2, 128)
    scale = np.maximum(np.abs(g).max(-1, keepdims=True) / FP8_MAX[fmt], 1e-8).astype(np.float32)
    codes = reference_round((g / scale).astype(np.float32).astype(np.float64), fmt)
    want = codes.astype(np.float32) * scale  # the product in float32, as stored values are
    np.testing.assert_array_equal(got.numpy(), want.reshape(6, 256))
    assert torch.equal(got[0, :128], torch.zeros(128))


def test_nan_is_refused_and_ste_passes_gradients():
    with pytest.raises(NonFiniteCacheError, match="NaN reached the e4m3 quantizer"):
        fp8_round(torch.tensor([1.0, float("nan")]), "e4m3")
    x = torch.randn(4, 64, requires_grad=True)
    fp8_quantize_dequantize(x, "e4m3", ste=True).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_specs_precisions_and_bytes_of_the_fp8_formats():
    spec = QuantizerSpec.from_precision("ce4m3r16", group_size=128, content_meta_dtype="float32")
    assert (spec.content_bits, spec.content_format, spec.rope_bits) == (8, "e4m3", 16)
    assert spec.precision == "ce4m3r16" and spec.fp8 and "asym+fp8" in spec.key
    assert (
        QuantizerSpec.from_precision("c4r4").key
        == "c4r4-asym-pertoken-g64-rne-content_bf16-rope_fp32"
    )
    # vLLM's fp8_ds_mla: 512 E4M3 bytes + 4 FP32 scales (16 B) + a 64-element BF16 RoPE key (128 B)
    assert LAYOUTS["fp8_ds_mla"].token_bytes() == 656
    # FP8 groups store a scale and no zero point: 512 + 8 BF16 scales; RoPE 64 + 1 FP32 scale
    assert layout("ce4m3re4m3").token_bytes() == 512 + 64 + 8 * ((8 * 2 + 4 + 7) // 8)
    x = torch.randn(3, 512)
    assert torch.equal(qdq_content(spec, x), fp8_quantize_dequantize(x, "e4m3", 128, torch.float32))
    assert torch.equal(qdq_rope(spec, x[:, :64]), x[:, :64])
    with pytest.raises(ConfigError, match="precision='c4re4'"):
        QuantizerSpec.from_precision("c4re4")
    with pytest.raises(ConfigError, match="content_bits \\(e4m3\\)"):
        QuantizerSpec(4, 4, content_format="e4m3")


def test_the_packed_cache_and_the_server_refuse_fp8_in_one_line():
    from quantmla.serving.settings import ServeSettings
    from quantmla_kernels.paged_cache.layout import check_packable

    with pytest.raises(
        ConfigError, match="FP8 formats and the engine formats: cache.backend=simulator"
    ):
        check_packable(LAYOUTS["fp8_ds_mla"])
    with pytest.raises(ConfigError, match="FP8, FP4 and codebook paths are simulated"):
        ServeSettings(precision="ce4m3r4")
