"""Generation through the simulated cache: each token quantized once as it enters the cache gives
exactly what re-quantizing the whole history every step gives; BF16 equals the unpatched model."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from quantmla import patch_model, set_policy, unpatch_model
from quantmla.cache.simulated import DequantizedLatentLayer
from quantmla.models.tiny import tiny_mla_config
from quantmla.quant import qdq_content, qdq_rope


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = tiny_mla_config(
        vocab_size=96, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64
    )
    return AutoModelForCausalLM.from_config(config).eval()


def greedy(model, prompt, steps=12, cache=None):
    return model.generate(
        prompt,
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        cache=cache,
    )


@pytest.mark.parametrize("precision", ["c4r4", "c2r4"])
def test_incremental_cache_equals_requantizing_history(model, precision):
    prompt = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    patch_model(model, precision, sink=2, recent=5)
    incremental = greedy(model, prompt)
    set_policy(model, incremental=False)
    requantized = greedy(model, prompt)
    unpatch_model(model)
    assert isinstance(incremental.past_key_values.layers[0], DequantizedLatentLayer)
    assert type(requantized.past_key_values.layers[0]) is not DequantizedLatentLayer
    assert torch.equal(incremental.sequences, requantized.sequences)
    for a, b in zip(incremental.logits, requantized.logits):
        assert torch.equal(a, b)  # bit-identical: the same per-token QDQ, computed once


def test_cache_keeps_dequantized_copy_through_crop_and_reorder(model):
    patch_model(model, "c4r4", sink=1, recent=2)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert isinstance(layer, DequantizedLatentLayer) and layer.keys_hat.shape == layer.keys.shape
    cache.crop(-2)
    cache.reorder_cache(torch.tensor([1, 0]))
    spec = layer.hat_spec
    assert torch.equal(layer.keys_hat, qdq_content(spec, layer.keys))
    assert torch.equal(layer.values_hat, qdq_rope(spec, layer.values))
    unpatch_model(model)


def test_appended_history_equals_concatenation_through_crop_and_reorder():
    """The in-place append (`appended`) against torch.cat: decode steps reuse the room (no copy of
    the history), a crop writes over the dropped rows, a reorder or a new batch starts a new room."""
    from quantmla.cache.simulated import appended

    gen = torch.Generator().manual_seed(4)
    history, room = None, None
    reference = torch.empty(2, 1, 0, 8)
    for step in [9, 1, 1, "crop", 1, "reorder", 1, 1, 20, 1]:
        if step == "crop":
            history, reference = history[..., :-3, :], reference[..., :-3, :]
            continue
        if step == "reorder":
            order = torch.tensor([1, 0])
            history, reference = history.index_select(0, order), reference.index_select(0, order)
            continue
        new = torch.randn(2, 1, step, 8, generator=gen)
        history, room = appended(history, room, new)
        reference = torch.cat([reference, new], dim=-2)
        assert torch.equal(history, reference)
    # a decode step into a room with space keeps it (no copy of the history)
    ptr = room.data_ptr()
    history, room = appended(history, room, torch.randn(2, 1, 1, 8, generator=gen))
    assert room.data_ptr() == ptr and history.data_ptr() == ptr


def test_bf16_generation_equals_the_unpatched_model(model):
    prompt = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    reference = greedy(model, prompt, steps=16).sequences
    patch_model(model, "bf16")
    patched = greedy(model, prompt, steps=16).sequences
    unpatch_model(model)
    assert torch.equal(patched, reference)
