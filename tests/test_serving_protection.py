"""quantmla/serving: the protection slots an engine's batches get (keyed by first block), the
rows they hold, the byte budget, and the settings' refusals (no vLLM needed)."""

import pytest
import torch

from quantmla.errors import ConfigError, QuantMLAError
from quantmla.quant import qdq_content, qdq_rope
from quantmla.serving.protection import ProtectionLostError, ProtectionTable
from quantmla.serving.settings import ServeSettings, predicted_capacity, protection_budget
from quantmla.spec import QuantizerSpec
from quantmla_kernels.paged_cache.layout import kept_in_protection
from quantmla_kernels.paged_cache.reference import protected_positions


def test_rows_follow_the_pool_rule_through_prefill_and_decode():
    table = ProtectionTable(2, sink=4, recent=8, width=3, dtype=torch.float32, device="cpu")
    rows = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    [slot] = table.assign([7], [0]).tolist()
    table.write(slot, 0, rows[:25])
    for t in range(25, 40):
        slots = table.assign([7], [t])
        table.write_next(slots, [t], rows[t : t + 1])
    held = table.buffer[slot]
    for pos in protected_positions(40, 4, 8).nonzero().flatten().tolist():
        where = pos if pos < 4 else 4 + pos % 8
        assert torch.equal(held[where], rows[pos])


def test_slots_are_reused_by_first_block_and_never_taken_from_the_batch():
    table = ProtectionTable(2, sink=1, recent=2, width=1, dtype=torch.float32, device="cpu")
    a, b = table.assign([10, 20], [0, 0]).tolist()
    assert a != b
    table.tokens[a], table.tokens[b] = 5, 5
    with pytest.raises(ProtectionLostError, match="holds 5"):
        table.assign([10], [4])  # a continuing request must find exactly its tokens
    # request 20 finished; a new request whose first block is 30 takes its slot (not 10's: in batch)
    [c] = table.assign([30], [0], batch_blocks={10}).tolist()
    assert c == b
    with pytest.raises(ProtectionLostError, match="has 5 cached tokens.*none"):
        table.assign([20], [5])  # 20's rows are gone: stop, never read another request's rows
    with pytest.raises(ProtectionLostError, match="all held by requests of this batch"):
        table.assign([40], [0], batch_blocks={10, 30})


@pytest.mark.parametrize(("sink", "recent"), [(4, 16), (0, 8), (4, 0)])
def test_held_rows_are_the_context_rows_a_chunk_reads(sink, recent):
    """After prefill chunks of any size (inside the sinks too), the slot's held rows are exactly
    the context's sinks and its last `recent` tokens, in position order, with their values."""
    rows = torch.randn(60, 8, dtype=torch.float64)
    table = ProtectionTable(1, sink, recent, 8, torch.float64, "cpu")
    table.assign([7], [0])
    start = 0
    for size in (2, 1, 3, 11, 20, 23):
        table.write(0, start, rows[start : start + size])
        start += size
        pos, held = table.held(0)
        want = torch.arange(start)
        want = want[(want < sink) | (want >= start - recent)]
        assert torch.equal(pos, want) and torch.equal(held, rows[want])


def test_budget_and_capacity_arithmetic():
    s = ServeSettings(precision="c4r4")
    one = 132 * 320 * 2 * 6  # sink + recent rows x (256 + 64) x BF16 x 6 layers
    assert protection_budget(s, 256, 64, 6, 8, 30_000_000) == 8 * one
    block = 184 * 16 * 6
    assert (
        predicted_capacity(s, 256, 64, 6, 16, 30_000_000, 8) == (30_000_000 - 8 * one) // block * 16
    )
    bf16 = ServeSettings(precision="bf16")
    assert predicted_capacity(bf16, 256, 64, 6, 16, 30_000_000, 8) == 30_000_000 // (640 * 96) * 16
    with pytest.raises(QuantMLAError, match="smaller than one request's BF16 protection"):
        protection_budget(s, 256, 64, 6, 8, one - 1)
    with pytest.raises(QuantMLAError, match="lower max_num_seqs to at most 3"):
        protection_budget(s, 256, 64, 6, 8, 3 * one + 5)


def _fake_vllm_config(
    tmp_path, kv_bytes, max_num_seqs=256, prefix=True, speculative=None, block_size=16, user=False
):  # fmt: skip
    """The parts of a `VllmConfig` the platform plug-in reads, over a stated-precision model."""
    from types import SimpleNamespace as NS

    model = NS(
        model=str(tmp_path), max_model_len=4096, use_mla=True,
        hf_config=NS(kv_lora_rank=256, qk_rope_head_dim=64), get_num_layers=lambda _: 6,
    )  # fmt: skip
    return NS(
        model_config=model, parallel_config=None, speculative_config=speculative,
        cache_config=NS(
            enable_prefix_caching=prefix, kv_cache_memory_bytes=kv_bytes, block_size=block_size,
            user_specified_block_size=user,
        ),
        scheduler_config=NS(max_num_seqs=max_num_seqs),
        additional_config={"quantmla": {"precision": "c4r4"}},
    )  # fmt: skip


def test_platform_lowers_max_num_seqs_and_takes_the_protection_out_of_the_budget(tmp_path, capsys):
    """The platform plug-in on a fresh config: prefix caching off and max_num_seqs lowered, each
    with one printed line; the kept slots' protection out of the budget, once."""
    from quantmla.serving.platform import PREFIX_CACHING_OFF, TAKEN, configure
    from quantmla.serving.settings import fitting_num_seqs

    s = ServeSettings(precision="c4r4")
    one, request = 132 * 320 * 2 * 6, 4096 * 184 * 6
    fits = fitting_num_seqs(s, 256, 64, 6, 64 << 20, 4096, 16)
    assert fits * one <= (64 << 20) - request < (fits + 1) * one
    config = _fake_vllm_config(tmp_path, 64 << 20)
    configure(config)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [PREFIX_CACHING_OFF, lines[1]] and f"max_num_seqs 256 -> {fits}" in lines[1]
    assert config.scheduler_config.max_num_seqs == fits
    assert not config.cache_config.enable_prefix_caching
    assert config.cache_config.kv_cache_memory_bytes == (64 << 20) - fits * one
    assert config.additional_config[TAKEN] == fits * one
    configure(config)  # a config is checked once
    assert config.cache_config.kv_cache_memory_bytes == (64 << 20) - fits * one
    assert not capsys.readouterr().err
    kept = _fake_vllm_config(tmp_path, 64 << 20, max_num_seqs=8, prefix=False)
    configure(kept)
    assert kept.scheduler_config.max_num_seqs == 8 and not capsys.readouterr().err
    with pytest.raises(QuantMLAError, match="cannot hold one 4096-token request"):
        configure(_fake_vllm_config(tmp_path, request + one - 1))
    with pytest.raises(QuantMLAError, match="speculative"):
        configure(_fake_vllm_config(tmp_path, 64 << 20, speculative=object()))


def test_platform_pages_are_the_backends(tmp_path, capsys):
    """vLLM's CPU platform picks 128-token pages for MLA where AMX is present (its own kernel's
    preference): the backend's default replaces it; a user's 128 is refused before any worker."""
    from quantmla.serving.platform import configure

    config = _fake_vllm_config(tmp_path, 64 << 20, block_size=128)
    configure(config)
    assert config.cache_config.block_size == 16
    configure(asked := _fake_vllm_config(tmp_path, 64 << 20, block_size=32, user=True))
    assert asked.cache_config.block_size == 32
    with pytest.raises(ConfigError, match=r"block_size=128 is not allowed; allowed: 16, 32, 64"):
        configure(_fake_vllm_config(tmp_path, 64 << 20, block_size=128, user=True))
    capsys.readouterr()


def test_settings_refuse_what_the_writer_cannot_pack():
    with pytest.raises(ConfigError, match="c5r4"):
        ServeSettings(precision="c5r4")  # 5-bit words would be 5 bytes: not packed
    assert ServeSettings(precision="c3r4").spec.content_bits == 3  # 8 codes in 3 bytes
    with pytest.raises(ConfigError, match="c4r16"):
        ServeSettings(precision="c4r16")  # a BF16 RoPE key is not a packed path here
    with pytest.raises(ConfigError, match="protection_dtype"):
        ServeSettings(precision="c4r4", protection_dtype="int8")


def test_settings_come_from_the_manifest_and_stated_fields_override_it(tmp_path):
    import json

    from quantmla.errors import DataNotFoundError
    from quantmla.serving.settings import resolve_settings

    manifest = {
        "format": "quantmla-export/1", "precision": "c2r4", "protection": {"sink": 8, "recent": 64},
        "quantizer": {"group_size": 64, "content_meta_dtype": "bfloat16", "rope_meta_dtype": "float32"},
    }  # fmt: skip
    (tmp_path / "quantmla.json").write_text(json.dumps(manifest))
    assert resolve_settings(tmp_path, None) == ServeSettings("c2r4", sink=8, recent=64)
    stated = resolve_settings(tmp_path, {"precision": "bf16"})
    assert stated.precision == "bf16" and stated.sink == 8  # the export's window kept
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(DataNotFoundError, match="no quantmla.json"):
        resolve_settings(plain, {"recent": 16})
    assert resolve_settings(plain, {"precision": "c4r4"}) == ServeSettings("c4r4")
    with pytest.raises(ConfigError, match="additional_config.quantmla.*recnet"):
        resolve_settings(tmp_path, {"recnet": 1})


def _rule_reference(q, c, k_r, w, spec, sink, recent, d_nope, d_v, scaling):
    """float64: query i reads token j ≤ i exact iff j < sink or i − j < recent, else dequantized."""
    n, heads, d_r = q.shape[0], q.shape[1], k_r.shape[1]

    def kv(latent, rope):
        k_nope, v = (latent @ w.T).view(n, heads, d_nope + d_v).split([d_nope, d_v], dim=-1)
        return torch.cat([k_nope, rope[:, None].expand(n, heads, d_r)], dim=-1), v

    (k, v), (k_hat, v_hat) = kv(c, k_r), kv(qdq_content(spec, c), qdq_rope(spec, k_r))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    exact = ((j < sink) | (i - j < recent) | (not spec.quantized))[..., None, None]
    keys, values = (
        torch.where(exact, k[None], k_hat[None]),
        torch.where(exact, v[None], v_hat[None]),
    )
    scores = torch.einsum("ihd,ijhd->ihj", q, keys) * scaling
    scores = scores.masked_fill((j > i)[:, None, :], float("-inf"))
    return torch.einsum("ihj,ijhd->ihd", scores.softmax(-1), values).reshape(n, heads * d_v)


def _random_prefill(n, seed, heads=2, d_c=64, d_r=64, d_nope=16, d_v=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d_nope + d_r, generator=g, dtype=torch.float64)
    c = torch.randn(n, d_c, generator=g, dtype=torch.float64)
    k_r = torch.randn(n, d_r, generator=g, dtype=torch.float64)
    w = torch.randn(heads * (d_nope + d_v), d_c, generator=g, dtype=torch.float64) / 8
    return q, c, k_r, w, d_nope, d_v


@pytest.mark.parametrize(
    ("n", "sink", "recent"), [(700, 4, 128), (700, 0, 0), (600, 4, 700), (520, 3, 1)]
)
def test_prefill_equals_the_per_query_rule_in_float64(n, sink, recent):
    """A whole prompt (blocks of queries gathering only the keys they read in each copy) against
    the rule written out per query."""
    from quantmla.attention import prefill_attention

    q, c, k_r, w, d_nope, d_v = _random_prefill(n, n + sink + recent)
    spec = QuantizerSpec.from_precision("c2r4")
    out = prefill_attention(q, c, k_r, lambda x: x @ w.T, spec, sink, recent, d_nope, d_v, 0.1)
    expected = _rule_reference(q, c, k_r, w, spec, sink, recent, d_nope, d_v, 0.1)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("precision", "chunks", "sink", "recent", "workspace"),
    [
        ("c4r4", [16] * 40, 4, 128, 64),  # chunks far smaller than the window
        ("c2r4", [48, 48, 100, 300, 144], 4, 128, 96),  # not block-aligned, mixed sizes
        ("c2r4", [100, 540], 4, 128, 1000),  # one context read
        ("c4r4", [3, 1, 5, 631], 4, 16, 32),  # chunks inside the sink
        ("c2r4", [200, 440], 0, 0, 50),  # no protection
        ("bf16", [48, 100, 492], 4, 128, 64),  # BF16 mode: the context is its own rows
    ],
)
@pytest.mark.parametrize("written", [False, True])
def test_chunked_prefill_equals_the_whole_prompt_rule(
    precision, chunks, sink, recent, workspace, written
):
    """Chunked prefill: each chunk over its own tokens + the context's protection rows (the sinks
    and the last `recent` before it) + its dequantized pages read `workspace` tokens at a time,
    LSE-merged — equals the per-query rule over the whole prompt in float64; `written`: the
    chunk's dequantized copies come from the cache reader, as in an engine that wrote them first."""
    from quantmla.attention import PrefillContext, prefill_attention

    n = sum(chunks)
    q, c, k_r, w, d_nope, d_v = _random_prefill(n, n + len(chunks))
    spec = QuantizerSpec.from_precision(precision)
    c_hat, k_hat = (qdq_content(spec, c), qdq_rope(spec, k_r)) if spec.quantized else (c, k_r)
    reads, cached = [], [0]  # cached[0]: the positions the cache holds

    def read(a, b):
        assert b <= cached[0], "read a position the cache does not hold"
        reads.append(b - a)
        return c_hat[a:b], k_hat[a:b]

    outs, start = [], 0
    for size in chunks:
        cached[0] = start + size if written else start
        pos = torch.arange(start)
        held = pos[kept_in_protection(pos, start, sink, recent)]
        rows = torch.cat([c, k_r], dim=-1)[held]
        context = PrefillContext(start, held, rows, read, workspace, written)
        end = start + size
        outs.append(prefill_attention(
            q[start:end], c[start:end], k_r[start:end], lambda x: x @ w.T, spec, sink, recent,
            d_nope, d_v, 0.1, context=context,
        ))  # fmt: skip
        start = end
    expected = _rule_reference(q, c, k_r, w, spec, sink, recent, d_nope, d_v, 0.1)
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-10, atol=1e-10)
    assert reads and max(reads) <= workspace  # the context went through the bounded reader


def test_merge_states_is_the_softmax_over_the_union():
    from quantmla_kernels.paged_cache.prefill import attend_scores, merge_states

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(5, 5, generator=g) > 0.3
    mask[:, 0] = True
    whole = attend_scores(q, k, v, mask, 0.3)
    a, b = (
        attend_scores(q, k[:, :2], v[:, :2], mask[:, :2], 0.3),
        attend_scores(q, k[:, 2:], v[:, 2:], mask[:, 2:], 0.3),
    )
    for got, want in zip(merge_states(*a, *b), whole):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    none = attend_scores(q, k, v, torch.zeros(5, 5, dtype=torch.bool), 0.3)  # a part nobody reads
    for got, want in zip(merge_states(*whole, *none), whole):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fused_cpu_attention_equals_the_score_matrix_causal_and_with_empty_rows():
    """`attend` (torch's fused CPU attention, values narrower than keys zero-padded) against
    `attend_scores` (the score matrix): causal (square, and more queries than keys), and masked with a row that reads nothing (out 0,
    lse −inf, which the fused op alone leaves at lse 0)."""
    from quantmla_kernels.paged_cache.prefill import attend, attend_scores

    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(3, 9, 16, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(3, 9, 8, generator=g, dtype=torch.float64)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    for got, want in zip(
        attend(q, k, v, None, 0.2, causal=True), attend_scores(q, k, v, causal, 0.2)
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    short = attend(q, k[:, :5], v[:, :5], None, 0.2, causal=True)  # top-left: row r reads 0 .. r
    for got, want in zip(short, attend_scores(q, k[:, :5], v[:, :5], causal[:, :5], 0.2)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    mask = torch.rand(9, 9, generator=g) > 0.5
    mask[4] = False
    got, want = attend(q, k, v, mask, 0.2), attend_scores(q, k, v, mask, 0.2)
    assert got[0].shape == (3, 9, 8) and torch.isneginf(got[1][:, 4]).all()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("n", "start", "base", "recent", "block", "scores"),
    [(200, 300, 150, 128, 64, 1 << 24), (200, 0, 0, 128, 64, 1 << 24), (37, 40, 4, 16, 8, 200),
     (130, 500, 373, 128, 32, 5000), (5, 9, 9, 1, 64, 1 << 24)],
)  # fmt: skip
def test_band_equals_the_masked_score_matrix(monkeypatch, n, start, base, recent, block, scores):
    """`_band` (blocks of queries over strided key windows, edge blocks padded, score matrices
    split by `BAND_SCORES`) against the float64 score matrix under 0 ≤ i − j < recent."""
    import quantmla_kernels.paged_cache.prefill as pa

    monkeypatch.setattr(pa, "BAND_BLOCK", block)
    monkeypatch.setattr(pa, "BAND_SCORES", scores)
    g = torch.Generator().manual_seed(2)
    m = start + n - base
    q = torch.randn(3, n, 16, generator=g, dtype=torch.float64)
    k = torch.randn(m, 3, 16, generator=g, dtype=torch.float64).transpose(0, 1)
    v = torch.randn(m, 3, 8, generator=g, dtype=torch.float64).transpose(0, 1)
    lag = (start + torch.arange(n))[:, None] - (base + torch.arange(m))[None]
    want = pa.attend_scores(q, k, v, (lag >= 0) & (lag < recent), 0.3)
    for got, expected in zip(pa._band(q, k, v, base, start, recent, 0.3), want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_bf16_mode_budget_must_hold_one_request_before_vllm_starts():
    """Without protection (BF16 mode) the budget still needs one max_model_len-token request's
    pages — checked in the user's process, whatever max_num_seqs is (issue #42's bad input)."""
    import sys

    from quantmla.serving.settings import fitting_num_seqs

    s = ServeSettings(precision="bf16")
    request = 4096 * (256 + 64) * 2 * 6
    assert fitting_num_seqs(s, 256, 64, 6, request, 4096, 16) == sys.maxsize
    with pytest.raises(
        QuantMLAError,
        match=rf"1000 cannot hold one 4096-token request \({request} B of pages\); raise",
    ):
        fitting_num_seqs(s, 256, 64, 6, 1000, 4096, 16)
