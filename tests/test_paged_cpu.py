"""kernels/paged_cache/cpu.py: the CPU decode over block tables (the C++ op's fused pass and the
torch path), against the float64 reference over the same pool, and the writer on raw page
storage."""

import pytest
import torch

from quantmla_kernels.paged_cache import native
from quantmla_kernels.paged_cache.cpu import (
    decode_packed,
    decode_packed_torch,
    decode_rows,
    decode_rows_torch,
    dequantize_pages,
)
from quantmla_kernels.paged_cache.ops import write as write_slots
from quantmla_kernels.paged_cache.ops import write_tokens
from quantmla_kernels.paged_cache.pool import PagePool, stacked_inputs
from quantmla_kernels.paged_cache.reference import decode_reference, read_tokens
from tests.test_paged_kernels import latents, small_layout


def filled_pool(lay, lengths, seed=0):
    pool = PagePool(lay, sum(-(-n // lay.page_tokens) for n in lengths) + 2)
    pool.free = torch.randperm(pool.n_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    for rid, n in enumerate(lengths):
        pool.add_request(rid)
        c, k = latents(n, lay.d_c, lay.d_r, seed=rid + seed)
        write_tokens(pool, rid, c[: n // 2], k[: n // 2])  # prefill, then one token at a time
        for t in range(n // 2, n):
            write_tokens(pool, rid, c[t : t + 1], k[t : t + 1])
    return pool


def _paths(fused, torch_path):
    """The fused C++ pass (where it builds: `native.available()`) and the torch path."""
    return [pytest.param(fused, id="fused", marks=pytest.mark.skipif(
        not native.available(), reason="no C++ compiler")), pytest.param(torch_path, id="torch")]  # fmt: skip


@pytest.mark.parametrize("decode", _paths(decode_packed, decode_packed_torch))
@pytest.mark.parametrize("precision", ["c4r4", "c2r4", "c8r8", "c3r1", "c6r3"])
@pytest.mark.parametrize("page_tokens", [16, 64])
def test_cpu_decode_equals_the_float64_reference(precision, page_tokens, decode):
    lay = small_layout(precision, sink=4, recent=24, page_tokens=page_tokens)
    lengths = [3, 28, 29, 100, 161]  # inside the window, at its edge, past it
    pool = filled_pool(lay, lengths)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(lengths), 4, lay.d_c, generator=gen)
    qr = torch.randn(len(lengths), 4, lay.d_r, generator=gen)
    want, want_lse = decode_reference(pool, list(range(len(lengths))), q, qr, 0.09)
    table, lens, prot = stacked_inputs(pool, list(range(len(lengths))))
    got, lse = decode(
        q_lat=q, q_rope=qr, scaling=0.09, table=table, lens=lens, layout=lay,
        storage=pool.storage, prot=prot,
    )  # fmt: skip
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", _paths(decode_packed, decode_packed_torch))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_protection_rows_of_a_buffer_by_slot(decode, dtype):
    """An engine's protection table read in place (slot per request, float32 or bfloat16) gives
    the decode of the same rows stacked per request."""
    lay = small_layout("c4r4", sink=4, recent=24, page_tokens=16)
    lengths = [3, 28, 100, 161]
    pool = filled_pool(lay, lengths, seed=3)
    table, lens, prot = stacked_inputs(pool, list(range(len(lengths))))
    prot = prot.to(dtype)
    slots = torch.tensor([5, 0, 2, 6])
    buffer = torch.randn(7, *prot.shape[1:]).to(dtype)  # other slots: other requests' rows
    buffer[slots] = prot
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(lengths), 4, lay.d_c, generator=gen)
    qr = torch.randn(len(lengths), 4, lay.d_r, generator=gen)
    args = dict(q_lat=q, q_rope=qr, scaling=0.09, table=table, lens=lens, layout=lay,
                storage=pool.storage)  # fmt: skip
    got, lse = decode(**args, prot=buffer, prot_slots=slots)
    want, want_lse = decode_packed_torch(**args, prot=prot.float())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_dequantized_pages_are_the_readers_values():
    lay = small_layout("c4r4", page_tokens=16)
    pool = filled_pool(lay, [50, 7])
    table, _, _ = stacked_inputs(pool, [0, 1])
    c_hat, k_hat = dequantize_pages(pool.storage, lay, table, 4)
    for rid, n in enumerate([50, 7]):
        c, k = read_tokens(pool, rid)
        assert torch.equal(c_hat[rid, :n], c) and torch.equal(k_hat[rid, :n], k)


@pytest.mark.parametrize("decode", _paths(decode_rows, decode_rows_torch))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_pages_decode_is_exact_softmax_attention(decode, dtype):
    gen = torch.Generator().manual_seed(2)
    pages = torch.randn(6, 16, 2 * 192, generator=gen).to(dtype)[..., 192:]  # a strided view
    table = torch.tensor([[4, 1, 0], [2, 5, 3], [1, 0, 0]])
    lens = torch.tensor([40, 17, 0], dtype=torch.int32)  # a request with nothing cached
    q, qr = torch.randn(3, 3, 128, generator=gen), torch.randn(3, 3, 64, generator=gen)
    got, lse = decode(q_lat=q, q_rope=qr, scaling=0.1, table=table, lens=lens, pages=pages, d_c=128)
    for b in range(2):
        rows = pages[table[b]].reshape(-1, 192)[: lens[b]].double()
        s = 0.1 * (q[b].double() @ rows[:, :128].T + qr[b].double() @ rows[:, 128:].T)
        torch.testing.assert_close(
            got[b].double(), torch.softmax(s, -1) @ rows[:, :128], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(lse[b].double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[2]).all()  # no key: lse −inf (the output is not read)


def test_writer_on_raw_storage_equals_the_pool_writer():
    lay = small_layout("c4r4", page_tokens=16)
    pool = filled_pool(lay, [37])
    raw = torch.zeros_like(pool.storage)
    c, k = latents(37, lay.d_c, lay.d_r, seed=0)
    pos = torch.arange(37)
    pages = torch.tensor(pool.requests[0].pages)[pos // 16]
    write_slots(raw, lay, pages, pos % 16, c, k)
    assert torch.equal(raw, pool.storage)


@pytest.mark.parametrize("precision", ["c4r4", "c2r4"])
def test_the_backends_triton_and_torch_paths_agree_on_engine_tensors(precision):
    """quantmla.serving's decode and writer on vLLM-shaped tensors (16-token blocks, int32 block
    tables, slot mapping with padding): the Triton kernels (interpreted on CPU) = the torch path."""
    from quantmla.serving.paged_attention import decode_latent, decode_latent_rows, write_packed
    from quantmla.serving.settings import ServeSettings

    lay = ServeSettings(precision=precision, sink=4, recent=24).layout(128, 64, 16)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 40, 90]
    table = torch.randperm(20, generator=gen)[:18].view(3, 6).to(torch.int32)
    slots = torch.cat([table[b, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
                       for b, n in enumerate(lengths)] + [torch.tensor([-1, -1])])  # fmt: skip
    c, k = latents(slots.shape[0], 128, 64, seed=4)
    stores = {}
    for kernel in ("torch", "triton"):
        stores[kernel] = torch.zeros(20, lay.page_bytes(), dtype=torch.uint8)
        write_packed(stores[kernel], lay, slots, c, k, kernel)
    assert torch.equal(stores["torch"], stores["triton"])
    lens = torch.tensor(lengths, dtype=torch.int32)
    q, qr = torch.randn(3, 4, 128, generator=gen), torch.randn(3, 4, 64, generator=gen)
    buffer = torch.randn(5, 28, 192, generator=gen).to(torch.bfloat16)  # an engine's table
    held = torch.tensor([3, 0, 4])  # each request's slot
    got = {
        kernel: decode_latent(q, qr, 0.1, table, lens, lay, stores["torch"], buffer, held, kernel)
        for kernel in ("torch", "triton")
    }
    torch.testing.assert_close(got["triton"], got["torch"], rtol=1e-4, atol=1e-4)
    rows = torch.randn(20, 16, 192, generator=gen).to(torch.bfloat16)
    got = {
        k: decode_latent_rows(q, qr, 0.1, table, lens, rows, 128, k) for k in ("torch", "triton")
    }
    torch.testing.assert_close(got["triton"], got["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("precision", ["c4r4", "c2r4", "c3r1"])
def test_context_reads_triton_gather_equals_the_torch_path_and_the_reader(precision):
    """A chunked prefill's context read (positions [start, end) of one request, not page-aligned)
    through the Triton gather into a workspace (interpreted on CPU) = the torch path = the
    reference reader's dequantized tokens."""
    from quantmla.serving.paged_attention import context_reader

    lay = small_layout(precision, page_tokens=16)
    pool = filled_pool(lay, [150], seed=5)
    want_c, want_k = read_tokens(pool, 0)
    table = pool.request(0).page_table().to(torch.int32)
    workspace = torch.empty(80, lay.d_c + lay.d_r, dtype=torch.float32)
    for kernel in ("torch", "triton"):
        read = context_reader(pool.storage, lay, table, workspace, kernel)
        for start, end in ((0, 16), (5, 70), (33, 97), (97, 150), (149, 150)):
            c, k = read(start, end)
            torch.testing.assert_close(c, want_c[start:end], rtol=0, atol=0)
            torch.testing.assert_close(k, want_k[start:end], rtol=0, atol=0)
