"""eval.kind=ruler: RULER S-NIAH-1/2/3 (Fig. 4) through lm-eval's `niah_single_*` tasks.

With eval.data=local (default) the samples come from quantmla.evaluation.lm_eval.niah (local essays, the
model's tokenizer, `eval.limit` samples per length, default 500 as in the paper); greedy decoding
through the prepared model's cache."""

from __future__ import annotations

from quantmla.evaluation.lm_eval.suites import RULER_TASKS, data_mode

PAPER_SAMPLES = 500


def import_upstream_ruler_quietly() -> None:
    """lm-eval's upstream niah YAMLs import prepare_niah, which tries to download nltk's punkt at
    import and prints that it did; our samples never use nltk: import it with the download off."""
    import contextlib
    import io
    from unittest import mock

    import nltk

    with (
        mock.patch.object(nltk, "download", lambda *a, **k: False),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        import lm_eval.tasks.ruler.prepare_niah  # noqa: F401


def evaluate(cfg, prepared) -> dict:
    """ruler/<task>/<length> and ruler/<task>/avg: string-match accuracy in %; docs/ruler/<task>/
    <length>: each sample's score (0-1, in doc_id order: the same samples for every cache)."""
    from quantmla.evaluation.lm_eval.runner import attach_results, run_lm_eval

    ev = cfg.eval
    import_upstream_ruler_quietly()
    local = data_mode(ev, prepared.paths.data_dir) == "local"
    specs = [f"quantmla_{RULER_TASKS[t]}" if local else RULER_TASKS[t] for t in ev.tasks]
    metadata = {
        "data_dir": str(prepared.paths.data_dir),
        "tokenizer": str(prepared.paths.checkpoint(cfg.model.path)),
        "max_seq_lengths": list(ev.context_lengths),
        "num_samples": ev.limit or PAPER_SAMPLES,
        "seed": cfg.seed,
    }
    results = run_lm_eval(
        cfg,
        prepared,
        specs,
        metadata,
        limit=None if local else ev.limit,
        max_length=max(ev.context_lengths),
    )
    metrics: dict = {"ruler/samples_per_length": metadata["num_samples"]}
    samples = results.get("samples") or {}
    for task in ev.tasks:
        row = results["results"][RULER_TASKS[task]]
        scores = [100 * float(row[f"{length},none"]) for length in ev.context_lengths]
        for length, score in zip(ev.context_lengths, scores):
            metrics[f"ruler/{task}/{length}"] = score
            if docs := _length_scores(samples.get(RULER_TASKS[task], ()), length):
                metrics[f"docs/ruler/{task}/{length}"] = docs
        metrics[f"ruler/{task}/avg"] = sum(scores) / len(scores)
    return attach_results(cfg, metrics, results)


def _length_scores(examples, length: int) -> list[float]:
    """The scores of one length's samples in doc_id order, from lm-eval's logged examples: a
    sample scores its own length and marks upstream's default lengths -1 (RULER's convention)."""
    key = str(length)
    ours = [ex for ex in examples if ex.get(key, -1) != -1 and ex.get("filter", "none") == "none"]
    return [float(ex[key]) for ex in sorted(ours, key=lambda ex: ex["doc_id"])]


def format_table(record: dict) -> str:
    m, ev = record["metrics"], record["config"]["eval"]
    lengths = ev["context_lengths"]
    lines = [f"{'task':<10}" + "".join(f"{length:>9}" for length in lengths) + f"{'avg':>9}"]
    for task in ev["tasks"]:
        cells = "".join(f"{m[f'ruler/{task}/{length}']:>9.2f}" for length in lengths)
        lines.append(f"{task:<10}{cells}{m[f'ruler/{task}/avg']:>9.2f}")
    return "\n".join(lines)
