"""Per-document scores from lm-eval's logged samples: what a paired comparison of two records on
the same documents needs (their difference's standard error is far below the two averages'
independent bound when the methods agree on most documents). Pure Python: the vLLM worker
trims its samples with it too."""

from __future__ import annotations


def trim(samples: dict) -> dict[str, list[dict]]:
    """lm-eval's `samples` (task → logged examples) without prompts, documents and responses:
    each example's doc_id, filter and numeric metric values (trimmed samples pass unchanged)."""
    return {task: [_scores(ex) for ex in examples] for task, examples in samples.items()}


def _scores(example: dict) -> dict:
    kept = {"doc_id": example["doc_id"], "filter": example.get("filter", "none")}
    names = example.get("metrics", [k for k in example if k not in kept])
    values = {m: example.get(m) for m in names}
    return kept | {m: float(v) for m, v in values.items() if isinstance(v, int | float)}


def document_scores(samples: dict, names: list[str], metric: str) -> list[float] | None:
    """One task's per-document values of `metric` ("acc_norm,none": name and filter), its own
    documents and then each subtask's in `names` order, each by doc_id; None when not logged."""
    name, _, filt = metric.partition(",")
    found = []
    for task in names:
        examples = [
            ex for ex in samples.get(task, ()) if ex.get("filter", "none") == (filt or "none")
        ]
        if any(name not in ex for ex in examples):
            return None
        found += [float(ex[name]) for ex in sorted(examples, key=lambda ex: ex["doc_id"])]
    return found or None
