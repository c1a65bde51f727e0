"""The C++ CPU op (kernels/paged_cache/dequant.cpp) against its torch path, bit for bit."""

import pytest
import torch

from quantmla_kernels.paged_cache import native
from quantmla_kernels.paged_cache.cpu import dequantize_pages_torch, dequantize_rows
from quantmla_kernels.paged_cache.pool import stacked_inputs
from tests.test_paged_cpu import filled_pool
from tests.test_paged_kernels import small_layout

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the CPU op")


@pytest.mark.parametrize("precision", ["c4r4", "c2r4", "c8r8", "c3r1", "c6r3", "c1r2"])
@pytest.mark.parametrize("meta", ["bfloat16", "float16", "float32"])
def test_native_rows_equal_the_torch_path_bit_for_bit(precision, meta):
    lay = small_layout(precision, page_tokens=16, content_meta_dtype=meta, rope_meta_dtype=meta)
    lengths = [50, 7, 33]
    pool = filled_pool(lay, lengths)
    table, _, _ = stacked_inputs(pool, [0, 1, 2])
    want = torch.cat(dequantize_pages_torch(pool.storage, lay, table, 4), dim=-1)
    assert torch.equal(dequantize_rows(pool.storage, lay, table, 4), want)
    # rows outside `keep` are zero, without reading their (here: garbage) bytes
    keep = torch.rand(want.shape[:2], generator=torch.Generator().manual_seed(0)) < 0.5
    got = dequantize_rows(pool.storage, lay, table, 4, keep)
    assert torch.equal(got, torch.where(keep[..., None], want, 0.0))


def test_native_refuses_a_page_outside_the_storage():
    lay = small_layout("c4r4", page_tokens=16)
    pool = filled_pool(lay, [20])
    table = torch.tensor([[0, pool.storage.shape[0]]])
    with pytest.raises(RuntimeError, match="outside the storage"):
        dequantize_rows(pool.storage, lay, table, 2)
