"""`cache.backend=packed`: decoding through the paged packed cache computes the simulator's
function — fed the simulator's greedy tokens, each step's logits are within float tolerance of the
simulator's and pick the same token wherever the simulator has a clear winner — and the pool holds
exactly the memory model's bytes."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from quantmla import patch_model, set_policy, unpatch_model
from quantmla.cache.packed import PackedLatentLayer, packed_bytes
from quantmla.errors import ConfigError
from quantmla.memory import CacheLayout
from quantmla.spec import QuantizerSpec
from tests.conftest import DATA_DIR, TINY_MLA, needs_tiny
from tests.test_generation import greedy


@pytest.fixture(scope="module")
def tiny():
    model = AutoModelForCausalLM.from_pretrained(TINY_MLA, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MLA)
    text = (DATA_DIR / "wikitext-2-raw-v1" / "wiki.test.raw").read_text()[:4000]
    return model, tokenizer(text, return_tensors="pt").input_ids


def teacher_forced(model, prompt, tokens, cache) -> list[torch.Tensor]:
    """Next-token logits of the prompt and then of each given token, one decode step at a time
    through `cache` (generation's path, fed the reference's tokens: a BF16 near-tie in the
    reference cannot send the two continuations apart)."""
    with torch.no_grad():
        logits = [model(prompt, cache=cache).logits[:, -1]]
        for token in tokens:
            logits.append(model(token.view(1, 1), cache=cache).logits[:, -1])
    return logits


@needs_tiny
@pytest.mark.parametrize(
    "precision, kernel, prompt_len, steps, recent",
    [
        ("c4r4", "torch", 150, 12, 128),
        ("c2r4", "torch", 150, 12, 128),
        ("c4r4", "triton", 40, 3, 8),  # interpreted Triton is slow: a short window, same paths
        pytest.param("c4r4", "triton", 140, 4, 128, marks=pytest.mark.slow),
    ],
)
def test_packed_generation_equals_the_simulator(tiny, precision, kernel, prompt_len, steps, recent):
    """Prompt + generation crosses the protection window (sink 4 + recent) and a page boundary."""
    model, ids = tiny
    prompt = ids[:, :prompt_len]
    patch_model(model, precision, recent=recent)
    try:
        simulated = greedy(model, prompt, steps)
        set_policy(model, backend="packed", kernel=kernel)
        cache = DynamicCache(config=model.config)
        packed = teacher_forced(model, prompt, simulated.sequences[0, prompt_len:-1], cache)
    finally:
        unpatch_model(model)
    assert all(isinstance(layer, PackedLatentLayer) for layer in cache.layers)
    for a, b in zip(packed, simulated.logits):
        tol = 0.05 * float(b.float().abs().max())
        assert float((a.float() - b.float()).abs().max()) <= tol
        top2 = b.float().topk(2).values[0]
        if float(top2[0] - top2[1]) > 2 * tol:  # a clear winner: the same greedy token
            assert int(a.argmax()) == int(b.argmax())
    tokens = prompt_len + steps - 1  # the last generated token is never fed back
    layout = CacheLayout(QuantizerSpec.from_precision(precision), 128, 64, recent=recent)
    assert cache.layers[0].tokens == tokens
    assert packed_bytes(cache) == model.config.num_hidden_layers * layout.persistent_bytes(tokens)


@needs_tiny
def test_packed_backend_refuses_padding_and_beam_search(tiny):
    model, ids = tiny
    patch_model(model, "c4r4")
    set_policy(model, backend="packed", kernel="torch")
    try:
        batch = ids[:, :20].repeat(2, 1)
        mask = torch.ones_like(batch)
        mask[1, :3] = 0  # left padding
        with pytest.raises(ConfigError, match="left padding"):
            model.generate(batch, attention_mask=mask, max_new_tokens=2, do_sample=False)
        with pytest.raises(ConfigError, match="beam search"):
            model.generate(ids[:, :20], max_new_tokens=2, num_beams=2, do_sample=False)
    finally:
        unpatch_model(model)


@needs_tiny
def test_generate_entry_point_prints_continuation_speed_and_bytes(capsys, monkeypatch):
    import sys

    from quantmla import generate

    monkeypatch.setattr(
        sys,
        "argv",
        [
            "quantmla.generate",
            "prompt=The history of",
            "max_new_tokens=3",
            "cache.kernel=torch",
            f"paths.data_dir={DATA_DIR}",
        ],
    )
    generate.main()
    out = capsys.readouterr().out
    assert "3 tokens in" in out and "cache.backend=packed" in out
    assert "cache bytes held for" in out and "BF16 latent cache" in out


@needs_tiny
def test_a_mixed_allocation_generates_the_same_text_packed_and_simulated(tiny):
    """One format per layer (1- to 8-bit integer widths and a BF16 layer): the packed cache holds each layer in
    its own layout, the BF16 layer stays a plain cache layer, and greedy text equals the simulator's."""
    model, ids = tiny
    layers = model.config.num_hidden_layers
    mixed = [("c2r4", "c4r4", "bf16", "c8r8", "c1r2", "c3r6")[i % 6] for i in range(layers)]
    prompt, steps = ids[:, :150], 12
    patch_model(model, mixed)
    try:
        simulated = greedy(model, prompt, steps).sequences
        set_policy(model, backend="packed", kernel="torch")
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            packed = model.generate(prompt, max_new_tokens=steps, do_sample=False, cache=cache)
    finally:
        unpatch_model(model)
    assert torch.equal(packed, simulated)
    kinds = [isinstance(layer, PackedLatentLayer) for layer in cache.layers]
    assert kinds == [p != "bf16" for p in mixed]
    tokens = prompt.shape[1] + steps - 1
    want = sum(
        CacheLayout(QuantizerSpec.from_precision(p), 128, 64).persistent_bytes(tokens)
        for p in mixed
        if p != "bf16"
    )
    assert packed_bytes(cache) == want
    with pytest.raises(ConfigError, match="one per MLA layer"):
        patch_model(model, mixed[:-1])
    unpatch_model(model)
