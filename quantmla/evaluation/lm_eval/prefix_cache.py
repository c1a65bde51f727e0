"""lm-eval's HF model with the prompt shared across a document's choices (eval.prefix_cache).

A multiple-choice document asks for the log-likelihood of each choice after one prompt; a
few-shot prompt (ARC 25-shot, HellaSwag 10-shot: 1–2K tokens) is then most of the work and HFLM
runs it once per choice. Here the requests are scored one sequence at a time in token order, and
each reuses the model's KV cache of the longest prefix it shares with the previous one (cropped
back to it; `quantmla.cache.simulated` keeps the dequantized copy in step). The cache is causal
and quantization is per token, so the scores are HFLM's up to float rounding
(tests/test_lm_eval_prefix_cache.py); requests longer than the model's window keep HFLM's
left-truncating path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm
from transformers import DynamicCache


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCachedHFLM(HFLM):
    """HFLM whose log-likelihood requests reuse the KV cache of their shared prefix."""

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        fits = [len(r[1]) + len(r[2]) <= self.max_length + 1 for r in requests]
        long = [r for r, ok in zip(requests, fits) if not ok]
        long_answers = iter(super()._loglikelihood_tokens(long, disable_tqdm) if long else [])
        order = sorted(
            (i for i, ok in enumerate(fits) if ok), key=lambda i: requests[i][1] + requests[i][2]
        )
        answers: dict[int, tuple[float, bool]] = {}
        cache, cached = None, []
        for i in tqdm(
            order,
            disable=disable_tqdm or self.rank != 0,
            desc="Running loglikelihood requests (prefix cache)",
        ):
            request, context, continuation = requests[i]
            tokens = (context + continuation)[:-1]
            # reuse at most up to the first position whose logits are needed (len(context) − 1)
            keep = min(shared_prefix(cached, tokens), len(context) - 1)
            if cache is None or keep == 0:
                cache, keep = DynamicCache(), 0
            elif keep < len(cached):
                cache.crop(keep - len(cached))
            inputs = torch.tensor([tokens[keep:]], dtype=torch.long, device=self.device)
            with torch.no_grad():
                logits = self.model(
                    inputs, cache=cache, use_cache=True, logits_to_keep=len(continuation)
                ).logits[0, -len(continuation) :, : self.vocab_size]
            cached = tokens
            logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
            target = torch.tensor(continuation, dtype=torch.long, device=self.device)
            answer = (
                float(logprobs.gather(1, target[:, None]).sum()),
                bool((logprobs.argmax(dim=-1) == target).all()),
            )
            answers[i] = answer
            self.cache_hook.add_partial("loglikelihood", request, answer)
        return [answers[i] if ok else next(long_answers) for i, ok in enumerate(fits)]
