"""The shared-prefix lm-eval model scores what HFLM scores (quantized cache, protected and
dequantized tokens both read, requests beyond the window truncated as HFLM does) while running
each shared prompt once."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantmla import patch_model
from quantmla.evaluation.lm_eval.prefix_cache import shared_prefix
from quantmla.evaluation.lm_eval.runner import prompt_metrics
from tests.conftest import TINY_MLA, needs_tiny


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2], [1, 2, 3]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([7], [1]) == 0


def test_prompt_metrics_count_requests_past_the_protected_tokens():
    lengths = {"arc": [100, 140, 300], "mmlu_a": [133], "mmlu_b": [132], "other": [999]}
    assert prompt_metrics(["arc"], lengths, 132) == {
        "tokens_median": 140.0,
        "beyond_protected": 200 / 3,
    }
    assert prompt_metrics(["mmlu", "mmlu_a", "mmlu_b"], lengths, 132)["beyond_protected"] == 50
    assert prompt_metrics(["gsm8k"], lengths, 132) == {}


def few_shot_requests(vocab: int) -> list[tuple]:
    """3 documents × 4 choices behind one 40-token shared "few-shot" prefix, choices of 1–5
    tokens, and one request longer than the window (64 tokens)."""
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    shots, out = tokens(40), []
    for doc in range(3):
        context = shots + tokens(6 + 3 * doc)
        for choice in range(4):
            out.append(((f"doc{doc}", f"choice{choice}"), context, tokens(1 + choice + doc % 2)))
    out.append((("long", "x"), tokens(80), tokens(3)))
    return out


@needs_tiny
@pytest.mark.parametrize("precision", ["c2r4", "bf16"])
def test_prefix_cached_scores_equal_hflm(precision):
    from lm_eval.models.huggingface import HFLM

    from quantmla.evaluation.lm_eval.prefix_cache import PrefixCachedHFLM

    model = AutoModelForCausalLM.from_pretrained(TINY_MLA, dtype=torch.float32).eval()
    if precision != "bf16":  # sink 2 + recent 8: most of each prompt is read dequantized
        patch_model(model, precision, sink=2, recent=8)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MLA)
    requests = few_shot_requests(model.config.vocab_size)
    fed = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: fed.append(kw.get("input_ids", args[0] if args else None).shape[-1]),
        with_kwargs=True,
    )
    shared = PrefixCachedHFLM(
        pretrained=model, tokenizer=tokenizer, batch_size=1, max_length=64, device="cpu"
    )
    ours = shared._loglikelihood_tokens(requests, disable_tqdm=True)
    ours_fed = sum(fed)
    hook.remove()
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=64, device="cpu")
    reference = plain._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in ours] == [g for _, g in reference]
    assert torch.allclose(
        torch.tensor([s for s, _ in ours], dtype=torch.float64),
        torch.tensor([s for s, _ in reference], dtype=torch.float64), rtol=0, atol=1e-4,
    )  # fmt: skip
    # each document's prompt ran once: 40 + 6 + 9 + 12 prompt tokens, then the choices' tokens
    window = [min(len(c) + len(x), 65) - 1 for _, c, x in requests]
    assert ours_fed < sum(window) / 2
