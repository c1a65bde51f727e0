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


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_with_narrower_values_equals_float64_softmax(masked):
    """MLA's values (64) are narrower than its keys (128 + 64 here): the padded call is the same
    attention as float64 math, causal or with a boolean mask."""
    from quantmla.attention import sdpa

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 40, 96, generator=gen) for _ in range(2))
    v = torch.randn(2, 3, 40, 32, generator=gen)
    allowed = torch.ones(40, 40, dtype=torch.bool).tril()
    if masked:
        allowed &= torch.rand(40, 40, generator=gen) < 0.8
        allowed |= torch.eye(40, dtype=torch.bool)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 96**0.5
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.double()
    got = sdpa(q, k, v, attn_mask=allowed) if masked else sdpa(q, k, v, is_causal=True)
    assert got.shape == v.shape[:-2] + (40, 32)
    assert torch.allclose(got.double(), ref, atol=1e-5)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_causal_region_is_the_float64_causal_attention_with_its_gradients(form):
    """Calibration's whole-sequence region (`causal_regions`): the output and the gradients reaching
    the latent and the RoPE key equal float64 attention under the causal mask, in both forms."""
    from quantmla.attention import absorbed_attention, causal_regions, expanded_attention

    gen = torch.Generator().manual_seed(3)
    b, h, n, d_c, d_nope, d_r, d_v = 2, 3, 24, 16, 8, 4, 6
    q_nope = torch.randn(b, h, n, d_nope, generator=gen)
    q_rot = torch.randn(b, h, n, d_r, generator=gen)
    w_kv_b = torch.randn(h * (d_nope + d_v), d_c, generator=gen) / d_c**0.5
    c0, k0 = torch.randn(b, n, d_c, generator=gen), torch.randn(b, n, d_r, generator=gen)

    def run(c, k_rot):
        regions = causal_regions(c, k_rot)
        if form == "expanded":
            return expanded_attention(q_nope, q_rot, regions, w_kv_b, d_nope, 0.3)
        w = w_kv_b.view(h, d_nope + d_v, d_c)
        return absorbed_attention(q_nope, q_rot, regions, w[:, :d_nope], w[:, d_nope:], 0.3)

    def reference(c, k_rot):
        kv = (c @ w_kv_b.double().T).view(b, n, h, -1).transpose(1, 2)
        k = torch.cat([kv[..., :d_nope], k_rot[:, None].expand(b, h, n, d_r)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1).double()
        scores = (q @ k.transpose(-1, -2)) * 0.3
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ kv[..., d_nope:]

    c, k_rot = c0.clone().requires_grad_(), k0.clone().requires_grad_()
    out = run(c, k_rot)
    out.pow(2).sum().backward()
    c64, k64 = c0.double().requires_grad_(), k0.double().requires_grad_()
    ref = reference(c64, k64)
    ref.pow(2).sum().backward()
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(c.grad.double(), c64.grad, atol=1e-4)
    assert torch.allclose(k_rot.grad.double(), k64.grad, atol=1e-4)


def test_transformers_mla_through_padded_sdpa_keeps_its_logits():
    """A random DeepSeek-V2 (values 64 wide, keys 128) switched to the padded SDPA gives the logits
    of transformers' own SDPA, with and without a padding mask; other models are left as they are."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quantmla.models.loading import PADDED_SDPA, use_padded_sdpa
    from quantmla.models.tiny import tiny_mla_v2_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mla_v2_config(512)).eval()
    ids = torch.randint(0, 512, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        want = [model(ids).logits, model(ids, attention_mask=mask).logits]
        assert use_padded_sdpa(model).config._attn_implementation == PADDED_SDPA
        got = [model(ids).logits, model(ids, attention_mask=mask).logits]
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert torch.allclose(got[1][0], want[1][0], atol=1e-5)
    assert torch.allclose(got[1][1, 5:], want[1][1, 5:], atol=1e-5)
    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    assert use_padded_sdpa(llama).config._attn_implementation == "sdpa"
