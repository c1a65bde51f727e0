"""quantmla.allocation: the exact optimum on brute-forced instances, the budget, determinism,
the bytes it is fed."""

import itertools

import numpy as np
import pytest

from quantmla.allocation import allocate, best_allocations, format_bytes, predicted_errors
from quantmla.errors import ConfigError

FORMATS = ["c2r4", "c4r4", "c4r8", "c8r8", "ce4m3r16", "bf16"]


def brute_force(errors, sizes, budget):
    layers, k = errors.shape
    best = None
    for picks in itertools.product(range(k), repeat=layers):
        total = sum(sizes[j] for j in picks)
        if total > budget * layers:
            continue
        value = sum(errors[i, j] for i, j in enumerate(picks))
        if best is None or (value, total) < best[:2]:
            best = (value, total, picks)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_optimum_equals_brute_force_and_respects_the_budget(seed):
    rng = np.random.default_rng(seed)
    sizes = format_bytes(FORMATS, 256, 64)
    errors = rng.integers(0, 1000, size=(4, len(FORMATS))).astype(float)  # exact sums
    errors[:, -1] = 0.0  # BF16 adds no error
    for budget in (sizes.min(), 200, 300, sizes.max()):
        got = allocate(errors, sizes, budget, FORMATS)
        value, total, picks = brute_force(errors, sizes, budget)
        assert got.predicted == value
        assert got.bytes_per_token * 4 == total <= budget * 4  # ties: fewest bytes
        assert got.precisions == tuple(FORMATS[j] for j in picks)
        assert allocate(errors, sizes, budget, FORMATS) == got  # deterministic


@pytest.mark.parametrize("seed", range(3))
def test_the_k_best_equal_the_brute_forced_ranking(seed):
    rng = np.random.default_rng(seed)
    sizes = format_bytes(FORMATS, 256, 64)
    errors = rng.random((4, len(FORMATS)))  # continuous: no ties, one ranking
    for budget in (150, 250, sizes.max()):
        feasible = sorted(
            (sum(errors[i, j] for i, j in enumerate(picks)), picks)
            for picks in itertools.product(range(len(FORMATS)), repeat=4)
            if sum(sizes[j] for j in picks) <= budget * 4
        )
        got = best_allocations(errors, sizes, budget, FORMATS, k=12)
        assert len(got) == min(12, len(feasible))
        for a, (value, picks) in zip(got, feasible):
            assert a.precisions == tuple(FORMATS[j] for j in picks)
            np.testing.assert_allclose(a.predicted, value, rtol=1e-12)
            assert a.bytes_per_token * 4 == sum(sizes[j] for j in picks) <= budget * 4
        assert got[0] == allocate(errors, sizes, budget, FORMATS)
    few = best_allocations(errors, sizes, sizes.min(), FORMATS, k=5)  # one feasible allocation
    assert [a.precisions for a in few] == [("c2r4",) * 4]


def test_bytes_errors_and_refusals():
    sizes = format_bytes(FORMATS, 256, 64)
    assert dict(zip(FORMATS, sizes.tolist()))["c4r4"] == 184 and sizes[-1] == 640
    e = predicted_errors([1.0, 2.0], [0.5, 4.0], [[0.1, 0.2]] * 2, [[0.3, 0.0]] * 2)
    np.testing.assert_allclose(e, [[0.25, 0.2], [1.4, 0.4]])
    with pytest.raises(ConfigError, match="budget_bytes=100.*>= 120 B/token"):
        allocate(np.zeros((3, len(FORMATS))), sizes, 100, FORMATS)
