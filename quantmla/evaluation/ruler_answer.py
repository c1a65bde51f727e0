"""eval.kind=ruler_answer: RULER S-NIAH's answers teacher-forced through the job's cache.

The samples are eval.kind=ruler's (quantmla.evaluation.lm_eval.niah, the same seed and lengths);
each sample's value (" " + the needle's value, after the ":" the model writes) follows its prompt
in one forward, and the record keeps the value's log-likelihood and whether greedy decoding would
copy it whole. Exact match over a few samples moves in steps of 100/n points; the log-likelihood
moves with every sample, so paired differences between caches (BF16, each path alone) say where
a retrieval loss comes from. As in the perplexity evaluation every query, the prompt's too, reads
the quantized history."""

from __future__ import annotations

from quantmla.errors import ConfigError
from quantmla.evaluation.lm_eval.suites import RULER_TASKS, check_essays, check_ruler_samples


def check(cfg, job) -> None:
    """eval.tasks / context_lengths / limit, and the local essays, before anything loads."""
    ev = cfg.eval
    check_ruler_samples(ev, getattr(job.model_config, "max_position_embeddings", None))
    if ev.limit is None or ev.limit < 1:
        raise ConfigError("eval.limit", ev.limit, ">= 1 samples per task and length")
    check_essays(job.paths.data_dir)


# What the model writes between RULER's answer prefix ("... mentioned in the provided text is")
# and the value: SmolLM2-MLA's greedy answer at BF16 is ": <value>", and string-match scoring
# ignores it. Fed as context, so the scored tokens are the value's alone (retrieval, not format).
ANSWER_LEAD = ":"


def answer_ids(tokenizer, sample: dict) -> tuple[list[int], list[int]]:
    """The context's tokens (eval.kind=ruler's prompt, then ANSWER_LEAD) and the value's (" " +
    value), encoded apart as lm-eval encodes a context and its continuation."""
    from quantmla.evaluation.lm_eval.niah import prompt_text

    def encode(text: str, **kwargs) -> list[int]:
        return list(tokenizer(text, **kwargs).input_ids)

    prompt = encode(prompt_text(sample)) + encode(ANSWER_LEAD, add_special_tokens=False)
    return prompt, encode(" " + sample["outputs"][0], add_special_tokens=False)


def score_answer(model, prompt: list[int], answer: list[int]) -> tuple[float, bool]:
    """The answer's log-likelihood (nats, summed over its tokens, float64) and whether every
    answer token is the model's argmax given the prompt and the answer before it."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + answer], device=device)
    with torch.no_grad():
        logits = model(ids, logits_to_keep=len(answer) + 1).logits[0, :-1]
    target = torch.tensor(answer, device=device)
    logp = torch.log_softmax(logits.double(), dim=-1).gather(1, target[:, None])
    return float(logp.sum()), bool((logits.argmax(-1) == target).all())


def evaluate(cfg, prepared) -> dict:
    """ruler_answer/<task>/<length>/{loglik,exact} (mean nats; %), their averages over lengths
    (<task>/avg/...), and docs/ruler_answer/<task>/<length>/{loglik,exact}: each sample's, in
    sample order (the same samples for every cache: paired)."""
    from tqdm.auto import tqdm

    from quantmla.evaluation.lm_eval.niah import generate
    from quantmla.tracking.store import Progress

    ev, tokenizer = cfg.eval, prepared.tokenizer
    progress = Progress(prepared.record_path, "ruler_answer.json")  # a stopped job resumes here
    metrics: dict = {"ruler_answer/samples_per_length": ev.limit}
    for task in ev.tasks:
        means = {"loglik": [], "exact": []}
        for length in ev.context_lengths:
            key = f"{task}/{length}"
            samples = generate(
                RULER_TASKS[task], length, tokenizer, prepared.paths.data_dir, ev.limit, cfg.seed
            )
            scored = progress.get(key)
            if scored:
                print(f"[quantmla] resuming {key}: {len(scored)} of {len(samples)} samples saved")
            for sample in tqdm(samples[len(scored) :], desc=key, leave=False):
                scored.append(score_answer(prepared.model, *answer_ids(tokenizer, sample)))
                progress.save(key, scored)
            loglik = [float(s[0]) for s in scored]
            exact = [float(bool(s[1])) for s in scored]
            metrics[f"docs/ruler_answer/{key}/loglik"] = loglik
            metrics[f"docs/ruler_answer/{key}/exact"] = exact
            for name, values, scale in (("loglik", loglik, 1), ("exact", exact, 100)):
                metrics[f"ruler_answer/{key}/{name}"] = scale * sum(values) / len(values)
                means[name].append(metrics[f"ruler_answer/{key}/{name}"])
        for name, values in means.items():
            metrics[f"ruler_answer/{task}/avg/{name}"] = sum(values) / len(values)
    return metrics


def format_table(record: dict) -> str:
    """Per task and length: exact match (%) / mean answer log-likelihood (nats)."""
    m, ev = record["metrics"], record["config"]["eval"]
    lengths = [*map(str, ev["context_lengths"]), "avg"]
    lines = ["| task | " + " | ".join(lengths) + " |", "|" + "---|" * (1 + len(lengths))]
    for task in ev["tasks"]:
        cells = [
            f"{m[f'ruler_answer/{task}/{n}/exact']:.1f} % / {m[f'ruler_answer/{task}/{n}/loglik']:.3f}"
            for n in lengths
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
