import pytest
import torch

from quantmla.attention import merge_partials, protected_mask, softmax_partial


def test_online_merge_equals_one_softmax():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 40, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(2, 3, 40, 7, generator=gen, dtype=torch.float64)
    allowed = torch.rand(2, 3, 5, 40, generator=gen) < 0.7
    allowed[..., 0] = True
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values
    split = torch.rand(40, generator=gen) < 0.4
    parts = [softmax_partial(scores, allowed & s, values) for s in (split, ~split)]
    assert torch.allclose(merge_partials(*parts).double(), ref, atol=1e-6)
    # a region empty for every row contributes nothing
    empty = softmax_partial(scores, torch.zeros_like(allowed), values)
    assert torch.allclose(merge_partials(*parts, empty).double(), ref, atol=1e-6)
    assert torch.equal(merge_partials(empty), torch.zeros_like(empty.o))


@pytest.mark.parametrize("sink,recent", [(0, 0), (4, 128), (2, 3), (10, 1)])
def test_protected_mask_semantics(sink, recent):
    q_slots = torch.arange(5, 25)
    mask = protected_mask(q_slots, 25, sink, recent)
    for i, t in enumerate(q_slots.tolist()):
        for j in range(t + 1):
            assert bool(mask[i, j]) == (j < sink or t - j < recent)
