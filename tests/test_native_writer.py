"""The C++ writer (kernels/paged_cache/dequant.cpp `quantize_pages`) against the torch writer,
byte for byte."""

import pytest
import torch

from quantmla_kernels.paged_cache import native
from quantmla_kernels.paged_cache.writer import write_torch
from tests.test_paged_kernels import small_layout

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the CPU op")


@pytest.mark.parametrize("precision", ["c4r4", "c2r4", "c8r8", "c3r1", "c6r3", "c1r2"])
@pytest.mark.parametrize("meta", ["bfloat16", "float16", "float32"])
def test_native_writer_bytes_equal_the_torch_writer(precision, meta):
    lay = small_layout(precision, page_tokens=16, content_meta_dtype=meta, rope_meta_dtype=meta)
    g = torch.Generator().manual_seed(3)
    n, pages = 40, 6
    c = torch.randn(n, lay.d_c, generator=g) * torch.rand(n, 1, generator=g) * 8
    k_r = torch.randn(n, lay.d_r, generator=g).to(torch.bfloat16)  # any float dtype in
    c[3] = 0.0  # an all-zero row: s floored, codes 0
    c[4] = 2.5  # a constant row of one sign
    c[5, : lay.spec.group_size] = -1e-30  # a tiny group
    order = torch.randperm(pages * lay.page_tokens, generator=g)[:n]
    page, slot = order // lay.page_tokens, order % lay.page_tokens
    want = torch.randint(0, 256, (pages, lay.page_bytes()), dtype=torch.uint8, generator=g)
    got = want.clone()
    write_torch(want, lay, page, slot, c, k_r)
    native.native_write(got, lay, page, slot, c, k_r)
    assert torch.equal(got, want)


def test_native_writer_refuses_a_slot_outside_the_storage():
    lay = small_layout("c4r4", page_tokens=16)
    storage = torch.zeros(2, lay.page_bytes(), dtype=torch.uint8)
    c, k_r = torch.randn(1, lay.d_c), torch.randn(1, lay.d_r)
    with pytest.raises(RuntimeError, match="outside the storage"):
        native.native_write(storage, lay, torch.tensor([2]), torch.tensor([0]), c, k_r)
