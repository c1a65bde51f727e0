"""The paged pool of the packed cache: the layout it allocates is the memory model's, pages come
back, and misuse fails in one line without changing the pool."""

import pytest

from quantmla.memory import PAGE_TOKENS, layout
from quantmla_kernels.paged_cache.pool import FREE, PagePool, PoolExhaustedError, RequestStateError


@pytest.mark.parametrize("precision", ["c4r4", "c2r4", "c4r16", "bf16"])
def test_sections_tile_the_page(precision):
    lay = layout(precision)
    spans = sorted(lay.sections().values())
    assert spans[0][0] == 0
    for (start, size), (nxt, _) in zip(spans, spans[1:]):
        assert start + size == nxt
    assert spans[-1][0] + spans[-1][1] == lay.page_bytes()


def test_c4r4_page_sections():
    s = layout("c4r4").sections()
    assert s["content_codes"] == (0, 64 * 256) and s["rope_codes"] == (16384, 64 * 32)
    assert s["content_scales"][1] == 64 * 8 * 2 and s["rope_scales"][1] == 64 * 1 * 4
    assert s["padding"] == (20288, 192)


@pytest.mark.parametrize("precision", ["c4r4", "c2r4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 1000, 4096])
def test_bytes_held_equal_the_memory_model(precision, tokens):
    lay = layout(precision)
    pool = PagePool(lay, n_pages=70)
    pool.add_request(7)
    pool.reserve(7, tokens)
    assert pool.request_bytes(7) == lay.persistent_bytes(tokens)


def test_free_list_returns_every_page_and_the_reverse_map_tracks_owners():
    pool = PagePool(layout("c4r4", d_c=128), n_pages=10)
    for rid, tokens in ((1, 130), (2, 64), (3, 1)):
        pool.add_request(rid)
        pool.reserve(rid, tokens)
    assert pool.pages_in_use() == 3 + 1 + 1
    page, within = pool.slot(1, 129)
    assert page == pool.request(1).pages[2] and within == 1
    assert int(pool.reverse_map[page]) == (1 << 32) | 2
    pool.reserve(2, 1)  # page boundary: the 65th token takes a new page
    assert len(pool.request(2).pages) == 2
    for rid in (1, 2, 3):
        pool.release(rid)
    assert sorted(pool.free) == list(range(10)) and bool((pool.reverse_map == FREE).all())


def test_misuse_fails_without_changing_the_pool():
    pool = PagePool(layout("c4r4"), n_pages=4)
    pool.add_request(1)
    pool.reserve(1, 100)
    free_before, pages_before = list(pool.free), list(pool.request(1).pages)
    with pytest.raises(
        PoolExhaustedError, match=r"needs 3 more page\(s\) for 200 token\(s\); 2 of 4 are free"
    ):
        pool.reserve(1, 200)
    assert pool.free == free_before and pool.request(1).pages == pages_before
    assert pool.request(1).tokens == 100
    pool.release(1)
    with pytest.raises(RequestStateError, match="use after free"):
        pool.release(1)
    with pytest.raises(RequestStateError, match="use after free"):
        pool.slot(1, 0)
    pool.add_request(2)
    with pytest.raises(RequestStateError, match="already in the pool"):
        pool.add_request(2)


def test_byte_offsets_are_64_bit():
    pool = PagePool(layout("c4r4"), n_pages=1)
    tokens = 32 * (1 << 20)  # batch 32 × 1M tokens in one layer's pool
    last_page = tokens // PAGE_TOKENS - 1
    offset = pool.byte_offset(last_page, "rope_zeros", 63)
    assert pool.layout.sections()["rope_zeros"] == (20_224, 64)
    assert offset == last_page * 20_480 + 20_224 + 63 > 2**31
