"""The RoPE path's calibration objective in O(n·d_r²): equal, in value and in gradient, to the full
causal positional score matrix computed directly (float64)."""

import pytest
import torch

from quantmla.calibration.objectives import causal_score_energy, positional_qk_loss
from quantmla.quant import qdq_rope
from quantmla.spec import QuantizerSpec
from quantmla.transforms import RopeTransform


def _direct_energy(a, b):
    scores = torch.einsum("bhnr,btr->bhnt", a, b)
    return scores.tril().pow(2).sum()


@pytest.mark.parametrize(("n", "block"), [(150, 64), (128, 64), (7, 16)])
def test_causal_score_energy_is_the_masked_score_matrix_energy(n, block):
    torch.manual_seed(n)
    a, b = torch.randn(2, 3, n, 8, dtype=torch.float64), torch.randn(2, n, 8, dtype=torch.float64)
    got = causal_score_energy(a, b, block)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(_direct_energy(a, b).item(), rel=1e-12)


@pytest.mark.parametrize("precision", [(2, 4), (4, 2), (4, 3)])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_positional_loss_value_and_gradient_equal_the_direct_form(precision, layout):
    """Loss and STE gradients w.r.t. the pair angles and log-scales equal those of
    ‖causal(Q M_Q Q(K M_K)ᵀ − Q Kᵀ)‖² / ‖causal(Q Kᵀ)‖², computed on the (n, n) matrix."""
    torch.manual_seed(0)
    spec = QuantizerSpec(*precision, group_size=16)
    q, k = (
        torch.randn(2, 3, 100, 32, dtype=torch.float64),
        torch.randn(2, 100, 32, dtype=torch.float64),
    )
    k[..., 5] *= 8  # an outlier channel, so scales matter
    start = 0.3 * torch.randn(16, dtype=torch.float64), 0.2 * torch.randn(16, dtype=torch.float64)
    grads = []
    for form in ("fast", "direct"):
        angles, log_scales = (t.clone().requires_grad_() for t in start)
        rope = RopeTransform(angles, log_scales.exp())
        key, query = rope.key_matrix(layout), rope.query_matrix(layout)
        if form == "fast":
            loss = positional_qk_loss(q, k, key, query, spec, ste=True)
        else:
            k_hat = qdq_rope(spec, k @ key, ste=True)
            error = torch.einsum("bhnr,btr->bhnt", q @ query, k_hat) - torch.einsum(
                "bhnr,btr->bhnt", q, k
            )
            loss = error.tril().pow(2).sum() / _direct_energy(q, k)
        loss.backward()
        grads.append((loss.detach(), angles.grad, log_scales.grad))
    (fast, ga, gs), (direct, da, ds) = grads
    assert fast.item() == pytest.approx(direct.item(), rel=1e-9) and fast > 0
    torch.testing.assert_close(ga, da, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(gs, ds, rtol=1e-7, atol=1e-12)


def test_positional_loss_is_zero_for_a_path_left_in_bf16():
    q, k = torch.randn(1, 2, 10, 8), torch.randn(1, 10, 8)
    rope = RopeTransform(torch.full((4,), 0.5), torch.full((4,), 2.0))
    loss = positional_qk_loss(
        q, k, rope.key_matrix("half"), rope.query_matrix("half"), QuantizerSpec(4, 16)
    )
    assert loss.item() == 0.0
