import numpy as np
import pytest
import torch

from quantmla.errors import ConfigError
from quantmla.quant import dequantize, pack, quantize, quantize_dequantize, unpack


def reference_qdq(x: np.ndarray, bits: int, g: int):
    """Independent float64 reference of docs/method.md §2 with the range widened to include 0 (numpy's
    round is half-to-even)."""
    xg = x.astype(np.float64).reshape(-1, g)
    m = 2**bits - 1
    lo = np.minimum(xg.min(1, keepdims=True), 0)
    hi = np.maximum(xg.max(1, keepdims=True), 0)
    s = np.maximum((hi - lo) / m, 1e-8)
    z = np.round(-lo / s)
    q = np.clip(np.round(xg / s) + z, 0, m)
    return ((q - z) * s).reshape(x.shape), q.reshape(x.shape), s


SHAPES = [(64,), (3, 64), (2, 5, 128), (4, 3, 2, 576), (7, 512)]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape, bits):
    gen = torch.Generator().manual_seed(bits * 100 + len(shape))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 0.5).float()
    ref, ref_codes, s = reference_qdq(x.numpy(), bits, 64)
    out = quantize_dequantize(x, bits, 64)
    codes = quantize(x, bits, 64).codes.reshape(shape).numpy()
    # float32 vs float64 can only flip a code whose x/s sits within float32 rounding of a .5 tie
    flipped = codes != ref_codes
    assert flipped.mean() <= 1e-3
    assert np.all(np.abs(codes.astype(int) - ref_codes.astype(int))[flipped] == 1)
    step = np.repeat(s, 64, axis=1).reshape(shape)
    err = np.abs(out.double().numpy() - ref)
    assert np.all(err[~flipped] <= 1e-5 * (np.abs(ref[~flipped]) + step[~flipped]))
    assert out.dtype == x.dtype and out.shape == x.shape


def test_ties_round_to_even():
    # lo=0, hi=15 -> s=1, z=0 at 4 bits: x/s lands exactly on .5 ties
    x = torch.zeros(64)
    x[1] = 15.0
    x[2:8] = torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 14.5])
    codes = quantize(x, 4).codes.flatten()
    assert codes[2:8].tolist() == [0, 2, 2, 4, 4, 14]


@pytest.mark.parametrize("value", [0.0, 3.7, -2.25, 1e4, -1e-6])
@pytest.mark.parametrize("meta", [None, torch.bfloat16, torch.float32])
def test_constant_groups_reconstruct_without_nan(value, meta):
    x = torch.full((3, 128), value)
    out = quantize_dequantize(x, 4, meta_dtype=meta)
    assert torch.isfinite(out).all()
    tol = 2**-8 if meta is torch.bfloat16 else 1e-6  # bf16 metadata: 8 significant bits
    assert torch.allclose(out, x, rtol=tol, atol=1e-7)


@pytest.mark.parametrize("bits", [2, 4])
def test_zero_point_is_an_integer_in_code_range_for_groups_of_one_sign(bits):
    """Where docs/method.md §2's z = round(-min/s) would leave [0, m] (a group of one sign), the widened
    range keeps it there (one stored byte) and the error within half a step."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.cat([torch.rand(3, 64, generator=gen) + 5, -(torch.rand(3, 64, generator=gen) + 5)])
    x = torch.cat([x, torch.randn(3, 64, generator=gen)])  # straddling: the paper's quantizer
    q = quantize(x, bits, meta_dtype=torch.bfloat16)
    m = 2**bits - 1
    assert q.zero[:3].eq(0).all() and q.zero[3:6].eq(m).all()
    assert torch.equal(q.zero, q.zero.round()) and q.zero.min() >= 0 and q.zero.max() <= m
    step = q.scale.float().repeat_interleave(64, -1).flatten(-2)
    assert ((dequantize(q) - x).abs() <= step / 2 * (1 + 2**-7)).all()
    straddle = x[6:]
    lo, hi = straddle.amin(-1, keepdim=True), straddle.amax(-1, keepdim=True)
    assert torch.equal(q.zero[6:].flatten(), torch.round(-lo / ((hi - lo) / m)).flatten())


def test_nonfinite_stays_in_its_group():
    x = torch.randn(4, 128)
    clean = quantize_dequantize(x, 4)
    x[1, 3] = float("nan")
    x[2, 70] = float("inf")
    out = quantize_dequantize(x, 4)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :64] = False
    mask[2, 64:] = False
    assert torch.equal(out[mask], clean[mask])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
def test_pack_unpack_exact(bits):
    codes = torch.randint(0, 2**bits, (5, 3, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)
    # the layout: each row is one little-endian bit stream, code i at bits [i·bits, (i+1)·bits)
    for row_codes, row_bytes in zip(codes.reshape(-1, 64).tolist(), packed.reshape(-1, 8 * bits)):
        stream = sum(code << (i * bits) for i, code in enumerate(row_codes))
        assert int.from_bytes(bytes(row_bytes.tolist()), "little") == stream
    with pytest.raises(ConfigError, match="pack bits=5"):
        pack(codes, 5)


def test_dequantize_of_packed_codes_equals_fake_quant():
    x = torch.randn(6, 512)
    q = quantize(x, 4, meta_dtype=torch.bfloat16)
    q.codes = unpack(pack(q.codes.flatten(-2), 4), 4).view_as(q.codes)
    assert torch.equal(dequantize(q), quantize_dequantize(x, 4, meta_dtype=torch.bfloat16))


def test_ste_passes_gradients():
    x = torch.randn(2, 64, dtype=torch.float64).float().requires_grad_()
    quantize_dequantize(x, 4, ste=True).sum().backward()
    # away from the group's min/max, x̂ = (round_ste(x/s) + z − z)·s has ∂x̂/∂x = 1 exactly
    inner = (x != x.amin(-1, keepdim=True)) & (x != x.amax(-1, keepdim=True))
    assert torch.allclose(x.grad[inner], torch.ones_like(x.grad[inner]))
    with torch.no_grad():
        assert torch.equal(quantize_dequantize(x, 4, ste=True), quantize_dequantize(x, 4))


def test_half_precision_input_keeps_dtype():
    x = torch.randn(2, 128).bfloat16()
    assert quantize_dequantize(x, 4).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [0, 9, 16, 2.5, True])
def test_bits_out_of_range(bits):
    with pytest.raises(ConfigError, match="bits"):
        quantize_dequantize(torch.randn(64), bits)


def test_group_size_must_divide():
    with pytest.raises(ConfigError, match="group_size"):
        quantize_dequantize(torch.randn(2, 100), 4, 64)
