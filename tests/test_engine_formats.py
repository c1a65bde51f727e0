"""The cache formats production engines ship (vLLM `fp8`, NVFP4, MXFP4, a rotated Lloyd-Max
codebook) on the one quantizer seam, against float64 references built from each format's
definition, and their exact bytes per token in the memory model."""

import math

import numpy as np
import pytest
import torch

from quantmla.calibration.objectives import content_qdq
from quantmla.errors import ConfigError
from quantmla.memory import LAYOUTS, layout
from quantmla.quant import (
    e2m1_round,
    gaussian_lloyd_max,
    hadamard_rotation,
    qdq_content,
    qdq_rope,
)
from quantmla.spec import QuantizerSpec
from quantmla.transforms import latent_magnitude
from tests.test_fp8_quant import reference_round, representable


def e2m1_values() -> np.ndarray:
    """E2M1 from its definition: 2 exponent bits (bias 1), 1 mantissa bit, no inf/NaN."""
    out = [
        (m / 2) * 2.0**0 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        for e in range(4)
        for m in range(2)
    ]
    return np.array(sorted(out))


def nearest_even(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid value by magnitude (the grid's odd positions have an odd mantissa), ties to
    the even one, saturating at the top; the sign kept."""
    a = np.minimum(np.abs(v), grid[-1])
    dist = np.abs(a[..., None] - grid)
    best = dist.min(-1, keepdims=True)
    tied = np.isclose(dist, best, rtol=0, atol=1e-12)
    even = tied & (np.arange(len(grid)) % 2 == 0)
    pick = np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))
    return np.copysign(grid[pick], v)


def test_e2m1_is_the_formats_nearest_value_ties_to_even():
    grid = e2m1_values()
    assert grid.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 7.0, 100.0])
    v = np.concatenate([ties, np.random.default_rng(0).normal(0, 3, 4000)])
    got = e2m1_round(torch.tensor(v)).numpy()
    assert np.array_equal(got, nearest_even(v, grid))
    assert got[:9].tolist() == [0, 1, 1, 2, 2, 4, 4, -4, -0.0]


def test_nvfp4_blocks_of_16_with_an_e4m3_scale():
    x = torch.randn(3, 256, dtype=torch.float64) * torch.logspace(-2, 1, 256, dtype=torch.float64)
    spec = QuantizerSpec.from_precision("cnvfp4r16")
    got = qdq_content(spec, x).numpy()
    blocks = x.numpy().reshape(3, 16, 16)
    e4m3 = np.concatenate([-representable("e4m3")[0][::-1], representable("e4m3")[0]])
    scale = reference_round(np.abs(blocks).max(-1, keepdims=True) / 6, "e4m3")
    assert np.isin(scale, e4m3).all()
    want = nearest_even(blocks / scale, e2m1_values()) * scale
    assert np.allclose(got, want.reshape(3, 256), rtol=0, atol=1e-12)


def test_mxfp4_blocks_of_32_with_a_power_of_two_scale():
    x = torch.randn(3, 64, dtype=torch.float64) * 7
    x[0, :32] = 0  # an all-zero block stays zero
    got = qdq_rope(QuantizerSpec.from_precision("c16rmxfp4"), x).numpy()
    blocks = x.numpy().reshape(3, 2, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = 2.0 ** (np.floor(np.log2(np.maximum(amax, 2.0**-127))) - 2)
    want = nearest_even(blocks / scale, e2m1_values()) * scale
    assert np.array_equal(got, want.reshape(3, 64))
    assert not got[0, :32].any()


def test_vllm_fp8_is_e4m3_at_scale_one():
    x = torch.randn(2, 64, dtype=torch.float64) * 50
    got = qdq_rope(QuantizerSpec.from_precision("c16re4m3t"), x).numpy()
    assert np.array_equal(got, reference_round(x.numpy(), "e4m3"))


def test_lloyd_max_codebook_is_maxs_table_and_its_own_fixed_point():
    levels = np.array(gaussian_lloyd_max(16))
    # J. Max, "Quantizing for minimum distortion" (1960), 16 levels, N(0, 1): the positive outputs
    maxs = [0.1284, 0.3881, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326]
    assert np.allclose(levels[8:], maxs, atol=1e-4) and np.allclose(levels[:8], -levels[8:][::-1])
    edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    from scipy.stats import norm

    centroids = (norm.pdf(edges[:-1]) - norm.pdf(edges[1:])) / (
        norm.cdf(edges[1:]) - norm.cdf(edges[:-1])
    )
    assert np.allclose(levels, centroids, atol=1e-10)


def test_rotated_codebook_quantizer():
    """Orthogonal rotation; each coordinate of the rotated vector, scaled by √d / ‖x‖ (‖x‖ as
    BF16 stores it), goes to its nearest level (argmin reference); Gaussian data lands at the
    16-level codebook's distortion (0.00950)."""
    rot = hadamard_rotation(256)
    assert torch.allclose(rot @ rot.T, torch.eye(256, dtype=torch.float64), atol=1e-12)
    spec = QuantizerSpec.from_precision("clm4r16")
    x = torch.randn(6, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    norm = x.norm(dim=-1, keepdim=True).to(torch.bfloat16).double()
    u = (x @ rot.T) * 16 / norm
    levels = torch.tensor(gaussian_lloyd_max(16), dtype=torch.float64)
    nearest = levels[(u[..., None] - levels).abs().argmin(-1)]
    want = (nearest * norm / 16) @ rot
    assert torch.allclose(qdq_content(spec, x), want, atol=1e-12)
    gauss = torch.randn(512, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    err = float(((qdq_content(spec, gauss) - gauss) ** 2).mean() / (gauss**2).mean())
    assert 0.0088 < err < 0.0102


@pytest.mark.parametrize("precision", ["ce4m3tre4m3t", "cnvfp4re4m3t", "cmxfp4rmxfp4", "clm4r16"])
def test_engine_formats_carry_gradients_for_calibration(precision):
    spec = QuantizerSpec.from_precision(precision)
    x = (torch.randn(4, 256) * 3).requires_grad_()
    k = (torch.randn(4, 64) * 3).requires_grad_()
    (qdq_content(spec, x, ste=True).sum() + qdq_rope(spec, k, ste=True).square().sum()).backward()
    assert torch.equal(qdq_content(spec, x, ste=True), qdq_content(spec, x))
    assert x.grad.abs().sum() > 0 and torch.isfinite(x.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize(
    "precision", ["c4r16", "c2r16", "ce4m3r16", "cmxfp4r16", "clm4r16", "cnvfp4r16", "ce4m3tr16"]
)
def test_the_latents_magnitude_changes_only_the_fixed_range_formats(precision):
    """A content transform's scale times a power of two dequantizes bit for bit alike where the
    format's scales follow the values; NVFP4 and tensor-scale FP8 instead depend on it: at the
    weightless-normalised u of a latent with Γ ≈ 1000 (SmolLM2-MLA's) their codes fall into E4M3's
    subnormals, and `latent_magnitude(Γ)` brings the error back to RTN's on c itself."""
    spec = QuantizerSpec.from_precision(precision)
    g = torch.Generator().manual_seed(0)
    gamma = 1000 * (1 + 0.01 * torch.randn(256, generator=g, dtype=torch.float64))
    c = torch.randn(512, 256, generator=g, dtype=torch.float64)  # the cached latent, RMS ≈ 1
    eye, ones = torch.eye(256, dtype=torch.float64), torch.ones(256, dtype=torch.float64)
    m = latent_magnitude(gamma)
    assert m == 1024.0
    at_u, at_c = (content_qdq(c, gamma, eye, s, spec) for s in (ones, m * ones))
    error = lambda x: float(((x - c) ** 2).sum() / (c**2).sum())  # noqa: E731
    assert spec.fixed_range("content") == (precision in ("cnvfp4r16", "ce4m3tr16"))
    if not spec.fixed_range("content"):
        assert torch.equal(at_u, at_c)
    else:
        rtn = error(qdq_content(spec, c))
        assert error(at_u) > 5 * rtn and error(at_c) < 1.05 * rtn


def test_latent_magnitude_is_the_nearest_power_of_two_of_the_geometric_mean():
    assert latent_magnitude(torch.tensor([1.0, 4.0])) == 2.0
    assert latent_magnitude(torch.tensor([-3.0, 3.0])) == 4.0  # log2 3 = 1.58
    assert latent_magnitude(torch.full((8,), 0.7)) == 0.5


def test_engine_format_bytes_are_the_engines():
    """At 512 + 64 (per token): vLLM fp8 576, fp8_ds_mla 656, nvfp4_ds_mla 352 (256 + 32 E4M3
    scales + 64 FP8 RoPE), MXFP4 both paths 306, rotated Lloyd-Max latent + BF16 RoPE 386."""
    bytes_ = {
        n: LAYOUTS[n].token_bytes()
        for n in ("fp8", "fp8_ds_mla", "nvfp4_ds_mla", "mxfp4", "turboquant4")
    }
    assert bytes_ == {
        "fp8": 576,
        "fp8_ds_mla": 656,
        "nvfp4_ds_mla": 352,
        "mxfp4": 306,
        "turboquant4": 386,
    }
    assert layout("cnvfp4re4m3t", 256, 64).token_bytes() == 128 + 16 + 64
    assert layout("c4r4", 256, 64).token_bytes() == 184  # ours keep their 8-byte padding


def test_engine_formats_refuse_widths_they_cannot_block():
    with pytest.raises(ConfigError, match=r"precision \(lm4\).*power-of-two d_c"):
        QuantizerSpec.from_precision("clm4r4").check_dims(320, 64)
    with pytest.raises(ConfigError, match=r"d_r=40 divisible by 32"):
        QuantizerSpec.from_precision("c4rmxfp4").check_dims(512, 40)
    with pytest.raises(ConfigError, match="engine format: e4m3t, nvfp4, mxfp4, lm4"):
        QuantizerSpec.from_precision("cfp4r4")
    QuantizerSpec.from_precision("cnvfp4r4", group_size=64).check_dims(256, 64)


@pytest.mark.parametrize("precision", ["cnvfp4re4m3t", "clm4r16"])
def test_a_job_runs_an_engine_format_and_the_packed_cache_refuses_it(tmp_path, precision):
    """The tiny model's perplexity job at an engine format, its bytes in the record; the packed
    cache and the server refuse it in one line."""
    from quantmla.run import run
    from quantmla.serving.settings import ServeSettings
    from quantmla_kernels.paged_cache.layout import check_packable
    from tests.conftest import needs_tiny, run_config, tiny_job

    if needs_tiny.args[0]:
        pytest.skip(needs_tiny.kwargs["reason"])
    record = run(run_config(*tiny_job(tmp_path, f"precision.name={precision}")))
    assert record["metrics"]["cache/bytes_per_token"] == layout(precision, 128, 64).token_bytes()
    assert math.isfinite(record["metrics"]["ppl/wikitext2"])
    with pytest.raises(ConfigError, match="engine formats: cache.backend=simulator"):
        check_packable(layout(precision))
    with pytest.raises(ConfigError, match="codebook paths are simulated"):
        ServeSettings(precision=precision)
