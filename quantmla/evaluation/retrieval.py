"""eval.kind=retrieval: single-needle retrieval on held-out phrasings (the second testbed, #13).

Documents come from `quantmla.data.retrieval` with the `HELDOUT` needle and question phrasings
(never used in training) and seven-digit values: in our filler haystack (`noise`, S-NIAH-1 style)
or in the C4 *evaluation* slice (`c4`, never trained on). Each document is exactly `length` tokens
(prompt + value + EOS); the model continues the prompt greedily through the prepared cache and a
sample counts when the value appears in the continuation."""

from __future__ import annotations

import random

import torch
from tqdm.auto import tqdm

HAYSTACKS = ("noise", "c4")
VALUE_STYLE = "number7"


def sampler_for(haystack: str, tokenizer, data_dir):
    from quantmla.data import document_stream, load_documents
    from quantmla.data.retrieval import RetrievalSampler

    if haystack == "noise":
        return RetrievalSampler(tokenizer)
    return RetrievalSampler(
        tokenizer, document_stream(load_documents("c4", "eval", data_dir), tokenizer)
    )


def documents(sampler, length: int, n: int, seed: int) -> list:
    """`n` held-out documents of `length` tokens, a function of (seed, length) alone."""
    from quantmla.data.retrieval import heldout_phrasing

    rng = random.Random(seed * 1_000_003 + length)
    return [sampler.sample(length, rng, heldout_phrasing, VALUE_STYLE) for _ in range(n)]


@torch.no_grad()
def accuracy(model, tokenizer, docs: list, max_new_tokens: int, desc: str = "retrieval") -> float:
    """Fraction of documents whose value appears in the greedy continuation of the prompt."""
    device = next(model.parameters()).device
    hits = 0
    for doc in tqdm(docs, desc=desc, leave=False):
        prompt = torch.tensor([doc.ids[: doc.prompt_len]], device=device)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        hits += doc.value in tokenizer.decode(out[0, prompt.shape[1] :])
    return hits / len(docs)


@torch.no_grad()
def answer_token_hits(model, docs: list) -> tuple[list[int], list[int], int]:
    """Teacher-forced diagnosis: (hits, totals) per answer position (value tokens, then EOS) and
    the documents whose every answer token is the argmax. A miss at position 0 is a lookup that
    found nothing; later misses are copy errors. Every document counted in the last number is a
    greedy hit too (the greedy path is the teacher path)."""
    device = next(model.parameters()).device
    hits: list[int] = []
    totals: list[int] = []
    whole = 0
    for doc in docs:
        ids = torch.tensor([doc.ids], device=device)
        guess = model(input_ids=ids).logits[0, doc.prompt_len - 1 : -1].argmax(-1).tolist()
        right = [g == t for g, t in zip(guess, doc.ids[doc.prompt_len :])]
        for position, ok in enumerate(right):
            if position == len(hits):
                hits.append(0)
                totals.append(0)
            hits[position] += ok
            totals[position] += 1
        whole += all(right)
    return hits, totals, whole


def check(cfg, job) -> None:
    """eval.kind=retrieval: one line naming the field before anything loads."""
    from quantmla.errors import ConfigError

    ev, max_positions = cfg.eval, getattr(job.model_config, "max_position_embeddings", None)

    for haystack in ev.haystacks:
        if haystack not in HAYSTACKS:
            raise ConfigError("eval.haystacks", haystack, HAYSTACKS)
    if not ev.haystacks:
        raise ConfigError("eval.haystacks", [], f"one or more of {HAYSTACKS}")
    if not ev.context_lengths:
        raise ConfigError("eval.context_lengths", [], "one or more lengths in tokens")
    for length in ev.context_lengths:
        if length < 128 or (max_positions and length > max_positions):
            raise ConfigError(
                "eval.context_lengths",
                length,
                f"128..{max_positions or '∞'} (the model's positions)",
            )
    if ev.limit is not None and ev.limit < 1:
        raise ConfigError("eval.limit", ev.limit, "null (100) or >= 1 documents per length")


def evaluate(cfg, prepared) -> dict:
    """retrieval/<haystack>/<length> (and bf16/retrieval/... when eval.compare_bf16), in %."""
    ev, tok = cfg.eval, prepared.tokenizer
    n = ev.limit or 100
    max_new = ev.max_gen_toks or 12
    metrics: dict = {"retrieval/samples_per_length": n}
    for haystack in ev.haystacks:
        sampler = sampler_for(haystack, tok, prepared.paths.data_dir)
        for length in ev.context_lengths:
            docs = documents(sampler, length, n, cfg.seed)
            key = f"retrieval/{haystack}/{length}"
            if ev.compare_bf16:
                with prepared.unquantized():
                    metrics[f"bf16/{key}"] = 100 * accuracy(
                        prepared.model, tok, docs, max_new, f"bf16 {key}"
                    )
            label = f"{cfg.precision.name} {cfg.method.name} {key}"
            metrics[key] = 100 * accuracy(prepared.model, tok, docs, max_new, label)
    return metrics


def format_table(record: dict) -> str:
    cfg, m = record["config"], record["metrics"]
    ev = cfg["eval"]
    head = "| haystack | cache | " + " | ".join(str(n) for n in ev["context_lengths"]) + " |"
    lines = [head, "|" + "---|" * (2 + len(ev["context_lengths"]))]
    label = f"{cfg['precision']['name']} {cfg['method']['name']}"
    for haystack in ev["haystacks"]:
        for prefix, name in (("bf16/", "bf16"), ("", label)):
            cells = [m.get(f"{prefix}retrieval/{haystack}/{n}") for n in ev["context_lengths"]]
            if any(c is not None for c in cells):
                body = " | ".join("—" if c is None else f"{c:.1f}" for c in cells)
                lines.append(f"| {haystack} | {name} | {body} |")
    lines.append(
        f"(% exact match, greedy, {m['retrieval/samples_per_length']} held-out-phrasing documents per length)"
    )
    return "\n".join(lines)
