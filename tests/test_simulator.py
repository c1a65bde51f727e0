"""The cache simulator on random-init models built from every published config in shared/."""

import pytest
import torch
from transformers import DynamicCache

from quantmla import patch_model, set_policy, unpatch_model
from quantmla.models.loading import random_model_from_config_file
from quantmla.quant import quantize_dequantize
from tests.conftest import MODEL_CONFIGS, rel_err

if not MODEL_CONFIGS:
    pytest.skip("shared/model-configs not found", allow_module_level=True)

T = 24


@pytest.fixture(scope="module", params=MODEL_CONFIGS, ids=lambda p: p.stem)
def model(request):
    return random_model_from_config_file(request.param, max_heads=8, experts_implementation="eager")


@pytest.fixture
def fresh(model):
    yield model
    unpatch_model(model).float()


def tokens(seed=0, length=T):
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, steps, mask=None, **kwargs):
    """`model.generate`'s greedy run of exactly `steps` tokens, with its step logits (pad id 0)."""
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )


@torch.no_grad()
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_bf16_patch_is_transparent(fresh, form):
    x = tokens()
    ref = fresh(x).logits
    patch_model(fresh, "bf16", form=form)
    assert rel_err(fresh(x).logits, ref) <= 1e-5


@torch.no_grad()
def test_full_protection_equals_bf16(fresh):
    x = tokens(1)
    ref = fresh(x).logits
    patch_model(fresh, "c4r4", sink=4, recent=T - 4)
    assert rel_err(fresh(x).logits, ref) <= 1e-5
    set_policy(fresh, sink=0, recent=0)
    assert rel_err(fresh(x).logits, ref) > 1e-4  # the quantizer really is on


class QDQCache(DynamicCache):
    """transformers' own cache, returning the quantize-dequantized history (C4R4, no protection)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        c, k_rot = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return (
            quantize_dequantize(c, 4, meta_dtype=torch.bfloat16),
            quantize_dequantize(k_rot, 4, meta_dtype=torch.float32),
        )


@torch.no_grad()
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_no_protection_equals_transformers_on_dequantized_cache(fresh, form):
    # float64: a last-bit difference between two float32 orders of summation can flip a rounding
    # code in a later layer and show up as a 1e-4 logit change; in float64 that cannot happen.
    fresh.double()
    x = tokens(2)
    ref = fresh(x, cache=QDQCache(config=fresh.config), use_cache=True).logits
    patch_model(fresh, "c4r4", sink=0, recent=0, form=form)
    assert rel_err(fresh(x).logits, ref) <= 1e-5


@torch.no_grad()
def test_prefill_equals_generate_steps_with_protection(fresh):
    fresh.double()  # see above: no rounding-code flips between the two orders of summation
    prompt = tokens(3, length=9)[:1].clamp_min(
        1
    )  # token 0 is the pad id: keep it out of the prompt
    patch_model(fresh, "c4r4", sink=2, recent=5)
    out = greedy(fresh, prompt, 10)
    steps = torch.stack(out.logits, dim=1)
    prefill = fresh(out.sequences).logits[:, prompt.shape[1] - 1 : -1]
    assert rel_err(steps, prefill) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("precision", ["bf16", "c4r4"])
def test_left_padded_row_generates_what_the_sequence_generates_alone(fresh, precision):
    """lm-eval's generation pads a batch on the left: the sink is each sequence's own first tokens,
    not the batch's first slots, so a padded row's logits (prefill and decode) are its own."""
    fresh.double()  # no rounding-code flips between the two orders of summation
    patch_model(fresh, precision, sink=2, recent=3)
    long, short = tokens(6, length=14).clamp_min(1)  # token 0 is the pad id
    short, pad = short[:9], 14 - 9
    batch = torch.stack([long, torch.cat([torch.zeros(pad, dtype=short.dtype), short])])
    mask = (torch.arange(14)[None] >= torch.tensor([[0], [pad]])).long()
    together, alone = greedy(fresh, batch, 6, mask), greedy(fresh, short[None], 6)
    assert rel_err(torch.stack(together.logits)[:, 1], torch.stack(alone.logits)[:, 0]) <= 1e-5


@torch.no_grad()
def test_packed_backend_generates_what_the_simulator_generates(fresh):
    """cache.backend=packed on every family's attention path (real d_c/d_r, random weights)."""
    prompt = tokens(5, length=12)[:1].clamp_min(1)
    patch_model(fresh, "c4r4", sink=2, recent=5)
    simulated = greedy(fresh, prompt, 8)
    set_policy(fresh, backend="packed", kernel="torch")
    packed = greedy(fresh, prompt, 8, cache=DynamicCache(config=fresh.config))
    assert torch.equal(packed.sequences, simulated.sequences)
    assert rel_err(torch.stack(packed.logits), torch.stack(simulated.logits)) <= 1e-4


@torch.no_grad()
@pytest.mark.parametrize("precision", ["c2r4", "bf16"])
def test_causal_prefill_equals_the_masked_sdpa(precision, monkeypatch):
    """The fused causal prefill (CPU, causal masks) against one SDPA over both copies with
    complementary masks, in float64 (no rounding-code flips): a whole sequence, a cache and the
    tokens after it, and a right-padded batch (its padded rows aside)."""
    import quantmla.simulator as simulator

    model = random_model_from_config_file(
        MODEL_CONFIGS[0],
        num_layers=2,
        vocab_size=512,
        max_heads=4,
        n_experts=4,
        ffn_size=256,
        experts_implementation="eager",
    ).double()
    patch_model(model, precision, sink=4, recent=64, form="expanded")
    x = torch.randint(1, 512, (2, 160), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(x)
    mask[1, 120:] = 0  # right padding

    def forwards():
        whole = model(x).logits
        cache = DynamicCache(config=model.config)
        first = model(x[:, :100], cache=cache, use_cache=True).logits
        rest = model(x[:, 100:], cache=cache, use_cache=True).logits
        padded = model(x, attention_mask=mask).logits
        return whole, torch.cat([first, rest], dim=1), padded

    calls = []
    prefill = simulator._causal_prefill
    monkeypatch.setattr(simulator, "_causal_prefill", lambda *a: calls.append(1) or prefill(*a))
    fused = forwards()
    assert len(calls) == 2 * 4  # both layers in each of the four forwards
    monkeypatch.setattr(simulator, "_reads_causally", lambda *a: False)
    masked = forwards()
    assert len(calls) == 8
    for a, b in zip(fused[:2], masked[:2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused[2][1, :120], masked[2][1, :120], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fused[2][0], masked[2][0], rtol=1e-10, atol=1e-10)
    unpatch_model(model)
