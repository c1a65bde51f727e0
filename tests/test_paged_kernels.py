"""kernels/paged_cache: the writer (Triton bit-exact vs the reference built on the quantizer) and
the decode kernel (vs dequantize-then-simulator attention), under TRITON_INTERPRET=1 on CPU."""

import math

import pytest
import torch

from quantmla.errors import ConfigError, NonFiniteCacheError
from quantmla.memory import PAGE_TOKENS, layout
from quantmla.quant import qdq_content, qdq_rope
from quantmla_kernels.paged_cache.ops import write_tokens
from quantmla_kernels.paged_cache.pool import PagePool, PoolExhaustedError
from quantmla_kernels.paged_cache.reference import read_tokens

PRECISIONS = ("c4r4", "c2r4", "c3r6", "c1r8")


def small_layout(precision="c4r4", d_c=128, d_r=64, **kw):
    return layout(precision, d_c=d_c, d_r=d_r, **kw)


def latents(n, d_c=128, d_r=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(n, d_c, generator=gen) * torch.linspace(0.1, 3, d_c)
    k = torch.randn(n, d_r, generator=gen) * 2
    return c, k


def hard_latents(n, d_c=128, d_r=64):
    """Constant groups (0, positive, negative), one-sign groups, huge and tiny magnitudes, ties."""
    c, k = latents(n, d_c, d_r, seed=1)
    c[0, :64] = 0.0
    c[1, :64] = 3.7
    c[2, 64:128] = -2.25
    c[3, :64] = torch.rand(64) + 5  # one sign: zero point 0
    c[4, :64] = 1e4 * torch.randn(64)
    c[5, :64] = 1e-6 * torch.randn(64)
    c[6, :64] = torch.arange(64) * 0.5 - 7.5  # .5 ties on the code grid
    k[7] = 0.0
    k[8] = -(torch.rand(d_r) + 1)
    return c, k


def pool_pair(lay, n_pages=8, order_seed=None):
    pools = [PagePool(lay, n_pages) for _ in range(2)]
    if order_seed is not None:  # pages handed out in a random physical order
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(order_seed)).tolist()
        for p in pools:
            p.free = perm[:]
    return pools


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("chunks", [[200], [1] * 9, [63, 1, 1, 70], [64, 64, 5]])
def test_triton_writer_is_bit_identical_to_the_reference(precision, chunks):
    lay = small_layout(precision)
    ref, tri = pool_pair(lay, order_seed=len(chunks))
    canary = 0xA5
    for p in (ref, tri):
        p.storage.fill_(canary)
        p.add_request(3)
    c, k = hard_latents(sum(chunks))
    start = 0
    for n in chunks:
        write_tokens(ref, 3, c[start : start + n], k[start : start + n], kernel="torch")
        write_tokens(tri, 3, c[start : start + n], k[start : start + n], kernel="triton")
        start += n
    assert torch.equal(ref.storage, tri.storage)
    held = set(ref.requests[3].pages)
    untouched = [p for p in range(ref.n_pages) if p not in held]
    assert untouched and (ref.storage[untouched] == canary).all()  # canary pages untouched
    assert torch.equal(ref.requests[3].protection, tri.requests[3].protection)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_reader_returns_the_quantizers_values(precision):
    lay = small_layout(precision)
    pool = PagePool(lay, 8)
    pool.add_request(0)
    c, k = hard_latents(150)
    write_tokens(pool, 0, c, k)
    c_hat, k_hat = read_tokens(pool, 0)
    spec = lay.spec
    assert torch.equal(c_hat, qdq_content(spec, c))
    assert torch.equal(k_hat, qdq_rope(spec, k))


def test_protection_buffer_holds_sinks_and_a_ring_of_the_last_recent():
    lay = small_layout("c4r4", sink=4, recent=128)
    pool = PagePool(lay, 8)
    req = pool.add_request(0)
    c, k = latents(300)
    rows = torch.cat([c, k], -1).to(torch.bfloat16)
    for t in range(133):  # one token at a time: the ring wraps exactly at the 128 boundary
        write_tokens(pool, 0, c[t : t + 1], k[t : t + 1], kernel="triton")
    assert torch.equal(req.protection[:4], rows[:4])
    ring = {4 + p % 128: p for p in range(133 - 128, 133)}
    for slot, p in ring.items():
        assert torch.equal(req.protection[slot], rows[p])
    assert 4 + 4 % 128 in ring and ring[8] == 132 and ring[4 + 5 % 128] == 5
    write_tokens(pool, 0, c[133:300], k[133:300])  # prefill-sized append
    for p in range(300 - 128, 300):
        assert torch.equal(req.protection[4 + p % 128], rows[p])


def test_writer_faults_leave_the_pool_unchanged():
    lay = small_layout("c4r4")
    pool = PagePool(lay, 2)
    pool.add_request(0)
    before = pool.storage.clone()
    c, k = latents(3 * PAGE_TOKENS)
    with pytest.raises(PoolExhaustedError, match="needs 3 more page\\(s\\).*2 of 2 are free"):
        write_tokens(pool, 0, c, k, kernel="triton")
    c[5, 3] = float("nan")
    with pytest.raises(NonFiniteCacheError, match="nothing was written"):
        write_tokens(pool, 0, c[:10], k[:10])
    assert torch.equal(pool.storage, before) and pool.requests[0].tokens == 0
    assert pool.pages_in_use() == 0
    with pytest.raises(ConfigError, match="bits.*packed cache"):
        write_tokens(PagePool(small_layout("c4r16"), 1), 0, c[:1], k[:1])
    with pytest.raises(ConfigError, match="group_size"):
        PagePool(layout("c4r4", d_c=96, d_r=64, group_size=64), 1)  # 96 % 64


# ------------------------------------------------------------------------------------ decoding


def filled_pool(precision, lengths, d_c=128, d_r=64, heads=4, seed=0, n_pages=None):
    """A pool with one request per length (random page order), and each request's new query."""
    lay = small_layout(precision, d_c=d_c, d_r=d_r)
    pages = n_pages or sum(math.ceil(t / PAGE_TOKENS) for t in lengths) + 2
    pool = PagePool(lay, pages)
    pool.free = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).tolist()
    for rid, t in enumerate(lengths):
        pool.add_request(rid)
        c, k = latents(t, d_c, d_r, seed=seed + rid)
        write_tokens(pool, rid, c, k)  # the reference writer (bit-identical, tested above)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(lengths), heads, d_c, generator=gen) * 0.3
    qr = torch.randn(len(lengths), heads, d_r, generator=gen) * 0.3
    return pool, list(range(len(lengths))), q, qr


def cosine(a, b):
    return float(
        torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0)
    )


def triton_decode(pool, ids, q, qr, scaling, **launch):
    """The Triton decode kernel itself over a pool's requests (`launch`: splits, block_h, ...)."""
    from quantmla_kernels.paged_cache.decode import launch_decode
    from quantmla_kernels.paged_cache.pool import stacked_inputs

    table, lens, prot = stacked_inputs(pool, ids)
    return launch_decode(
        q_lat=q, q_rope=qr, scaling=scaling, table=table, lens=lens, layout=pool.layout,
        storage=pool.storage, prot=prot, **launch,
    )  # fmt: skip


# Tolerances (fp32 kernel vs float64 reference on the same dequantized values): relative
# max-abs error ≤ 1e-5 of the output's scale, cosine ≥ 0.9995 (in practice ~1 − 1e-12), lse ≤ 1e-5.
def assert_close_to_reference(out, lse, ref, ref_lse):
    assert cosine(out, ref) >= 0.9995
    assert float((out.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert float((lse.double() - ref_lse).abs().max()) <= 1e-5


@pytest.mark.parametrize("precision", PRECISIONS)
def test_decode_matches_the_dequantize_then_attend_reference(precision):
    from quantmla_kernels.paged_cache.reference import decode_reference

    lengths = [1, 4, 5, 63, 64, 65, 131, 132, 133, 700]
    pool, ids, q, qr = filled_pool(precision, lengths)
    out, lse = triton_decode(pool, ids, q, qr, scaling=0.125, num_splits=3)
    ref, ref_lse = decode_reference(pool, ids, q, qr, scaling=0.125)
    assert_close_to_reference(out, lse, ref, ref_lse)


def test_decode_is_split_invariant_including_empty_splits():
    from quantmla_kernels.paged_cache.reference import decode_reference

    pool, ids, q, qr = filled_pool("c4r4", [5, 200, 700], heads=3)
    ref, ref_lse = decode_reference(pool, ids, q, qr, scaling=0.1)
    results = [triton_decode(pool, ids, q, qr, 0.1, num_splits=s) for s in (1, 4, 20)]
    for out, lse in results:  # 20 splits > 11 pages: most splits of the short requests are empty
        assert_close_to_reference(out, lse, ref, ref_lse)
    assert float((results[0][0] - results[2][0]).abs().max()) <= 1e-5


def test_decode_reads_protected_rows_unquantized():
    """Changing a protected token's packed copy changes nothing; changing its BF16 row does."""

    pool, ids, q, qr = filled_pool("c2r4", [300], heads=2)
    before, _ = triton_decode(pool, ids, q, qr, 0.2, num_splits=2)
    request = pool.requests[0]
    page0 = request.pages[0]
    sec = pool.layout.sections()["content_codes"]
    pool.storage[page0, sec[0] : sec[0] + 2 * pool.layout.d_c // 4] ^= 0xFF  # tokens 0-1: sinks
    after, _ = triton_decode(pool, ids, q, qr, 0.2, num_splits=2)
    assert torch.equal(before, after)
    request.protection[0] += 1.0
    changed, _ = triton_decode(pool, ids, q, qr, 0.2, num_splits=2)
    assert not torch.allclose(before, changed)


def test_bf16_page_baseline_and_dequantized_workspace_match_the_reference():
    """The latency sweep's baselines compute the same attention: the BF16-page kernel (`ops.decode_rows`,
    BF16 mode's decode) over the workspace the dequantize kernel builds equals the packed kernel
    with protection off."""
    from quantmla_kernels.paged_cache.baselines import dequantize_pages
    from quantmla_kernels.paged_cache.ops import decode_rows
    from quantmla_kernels.paged_cache.pool import stacked_inputs
    from quantmla_kernels.paged_cache.reference import decode_reference

    lay = small_layout("c4r4", sink=0, recent=0)
    pool = PagePool(lay, 12)
    pool.free = torch.randperm(12, generator=torch.Generator().manual_seed(3)).tolist()
    for rid, t in enumerate([70, 300]):
        pool.add_request(rid)
        c, k = latents(t, seed=rid)
        write_tokens(pool, rid, c, k)
    q = torch.randn(2, 4, 128) * 0.3
    qr = torch.randn(2, 4, 64) * 0.3
    workspace = dequantize_pages(pool, dtype=torch.float32)
    c_hat, k_hat = read_tokens(pool, 1)
    table, lens, _ = stacked_inputs(pool, [0, 1])
    assert torch.equal(workspace[table[1, 0], :, :128], c_hat[:64])
    out, lse = decode_rows(
        q_lat=q,
        q_rope=qr,
        scaling=0.125,
        table=table,
        lens=lens,
        pages=workspace,
        d_c=128,
        kernel="triton",
    )
    ref, ref_lse = decode_reference(pool, [0, 1], q, qr, 0.125)
    assert_close_to_reference(out, lse, ref, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_kernels_on_cuda_match_the_references(precision):
    """On a GPU: the compiled writer is bit-identical and the decode kernel (BF16 dots) within
    the stated bounds of the float64 reference at DeepSeek dims."""
    from quantmla_kernels.paged_cache.reference import decode_reference

    lay = layout(precision)
    ref, tri = PagePool(lay, 40, device="cuda"), PagePool(lay, 40, device="cuda")
    for p in (ref, tri):
        p.add_request(0)
    c, k = latents(700, 512, 64)
    c[3, :64] = 0.0
    write_tokens(ref, 0, c.cuda(), k.cuda(), kernel="torch")
    write_tokens(tri, 0, c.cuda(), k.cuda(), kernel="triton")
    assert torch.equal(ref.storage, tri.storage)
    q, qr = (
        torch.randn(1, 16, 512, device="cuda") * 0.05,
        torch.randn(1, 16, 64, device="cuda") * 0.05,
    )
    out, lse = triton_decode(tri, [0], q, qr, 0.07)
    expected, expected_lse = decode_reference(tri, [0], q, qr, 0.07)
    assert cosine(out, expected) >= 0.9995
    assert float((lse.double() - expected_lse).abs().max()) <= 1e-2
