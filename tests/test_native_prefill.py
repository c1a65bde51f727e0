"""The exact copies' pass of a quantized prefill chunk (`prefill.merge_window`): the C++ op and the
torch passes, each merged into partial results already held, against the rule written as one
float64 score matrix — sinks read at or after them, the band 0 ≤ i − j < recent."""

import pytest
import torch

from quantmla_kernels.paged_cache import native
from quantmla_kernels.paged_cache.prefill import attend_scores, merge_states, merge_window

needs_native = pytest.mark.skipif(not native.available(), reason="the C++ op did not build")


@pytest.mark.parametrize(
    ("heads", "n", "start", "sink", "recent", "before"),
    [
        (4, 253, 0, 4, 128, 0),  # a first chunk: queries before the sinks and the band's start
        (4, 256, 3072, 4, 128, 127),  # a later chunk: the protection rows before it
        (3, 37, 40, 4, 16, 15),  # blocks cut mid-band
        (2, 5, 9, 4, 1, 0),  # recent 1: each query its own exact copy
        (2, 3, 0, 4, 128, 0),  # a chunk inside the sinks
        (2, 70, 2, 4, 0, 0),  # no band: the sinks alone
        (2, 70, 100, 0, 128, 127),  # no sinks
    ],
)
@pytest.mark.parametrize("native_op", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_window_merge_equals_the_rule_merged_into_held_parts(
    heads, n, start, sink, recent, before, native_op, dtype
):
    g = torch.Generator().manual_seed(n + start)
    sinks = list(range(min(sink, start + n)))
    base = max(len(sinks), start - before)
    j = sinks + list(range(base, start + n))
    q = torch.randn(heads, n, 16, generator=g, dtype=torch.float64)
    k = torch.randn(len(j), heads, 16, generator=g, dtype=torch.float64).transpose(0, 1)
    v = torch.randn(len(j), heads, 8, generator=g, dtype=torch.float64).transpose(0, 1)
    held_out = torch.randn(heads, n, 8, generator=g, dtype=torch.float64)
    held_lse = torch.randn(heads, n, generator=g, dtype=torch.float64)
    held_out[:, ::3], held_lse[:, ::3] = 0.0, float("-inf")  # rows that read nothing yet

    i = start + torch.arange(n)[:, None]
    key = torch.tensor(j)[None]
    mask = ((key < sink) & (key <= i)) | ((i - key >= 0) & (i - key < recent))
    want = merge_states(held_out, held_lse, *attend_scores(q, k, v, mask, 0.4))

    out, lse = held_out.to(dtype), held_lse.to(dtype)
    merge_window(*(t.to(dtype) for t in (q, k, v)), j, start, sink, recent, 0.4, out, lse,
                 native_op=native_op)  # fmt: skip
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))
    torch.testing.assert_close(out.double(), want[0], rtol=tol, atol=tol)
    finite = torch.isfinite(want[1])
    torch.testing.assert_close(lse.double()[finite], want[1][finite], rtol=tol, atol=tol)


def test_window_merge_refuses_exact_copies_with_a_gap():
    q = torch.zeros(1, 4, 8)
    k, v = torch.zeros(1, 6, 8), torch.zeros(1, 6, 8)
    out, lse = torch.zeros(1, 4, 8), torch.full((1, 4), float("-inf"))
    with pytest.raises(RuntimeError, match="not contiguous"):
        merge_window(q, k, v, [0, 1, 5, 6, 8, 9], 6, 2, 4, 1.0, out, lse)
