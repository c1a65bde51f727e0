"""RULER S-NIAH answers teacher-forced through each cache (eval=ruler_answer): per task, each cell's
whole-answer argmax rate and mean answer log-likelihood, and its change from BF16 paired over the
same samples (`python -m analysis.tables ruler_answer`; experiment smol_ruler_answer)."""

from __future__ import annotations

import numpy as np

from analysis import common

PRECISIONS = ("bf16", "c4r4", "c4r8", "c4r16", "c16r4", "c16r8")
METHODS = ("rtn", "quantmla")
LABEL = {"rtn": "RTN", "quantmla": "QuantMLA"}


def _samples(metrics: dict, task: str, lengths: list[int], name: str) -> np.ndarray:
    return np.concatenate(
        [np.asarray(metrics[f"docs/ruler_answer/{task}/{n}/{name}"], float) for n in lengths]
    )


def cells(records: list[dict]) -> dict[tuple, dict]:
    """The newest eval=ruler_answer record of each (precision, method); BF16's method is None."""
    found: dict[tuple, dict] = {}
    for r in records:
        c = r["config"]
        if c["eval"]["kind"] != "ruler_answer":
            continue
        key = (
            c["precision"]["name"],
            None if c["precision"]["name"] == "bf16" else c["method"]["name"],
        )
        if key not in found or r.get("created", "") >= found[key].get("created", ""):
            found[key] = r
    return found


def _scores(record: dict, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Per sample over the record's lengths: the answer's log-likelihood and whether it is copied."""
    m, lengths = record["metrics"], record["config"]["eval"]["context_lengths"]
    return tuple(_samples(m, task, lengths, name) for name in ("loglik", "exact"))


def loglik_change(bf16: dict, record: dict, task: str) -> np.ndarray | None:
    """Per sample, the cache's answer log-likelihood minus BF16's (None: not the same samples)."""
    ours, ref = _scores(record, task)[0], _scores(bf16, task)[0]
    return ours - ref if ours.size == ref.size else None


def copied(record: dict, task: str) -> float:
    """The share of samples (%) whose whole answer the cache's greedy argmax copies."""
    return 100 * _scores(record, task)[1].mean()


def mean_se(d: np.ndarray) -> str:
    mean, se = common.mean_se(d)
    return f"{mean:+.3f} ± {se:.3f}"


def answer_rows(records: list[dict]) -> list[list[str]]:
    found = cells(records)
    header = ["task", "precision", "method", "answers copied (%)", "answer log-lik (nats)",
              "Δ log-lik vs BF16 (paired ± s.e.)", "log-lik below BF16", "copied: lost / gained vs BF16"]  # fmt: skip
    rows = [header]
    bf16 = found.get(("bf16", None))
    tasks = sorted({t for r in found.values() for t in r["config"]["eval"]["tasks"]})
    for task in tasks:
        for precision in PRECISIONS:
            for method in (None,) if precision == "bf16" else METHODS:
                record = found.get((precision, method))
                if record is None or task not in record["config"]["eval"]["tasks"]:
                    continue
                loglik, exact = _scores(record, task)
                delta = below = changed = "—"
                d = (
                    None
                    if bf16 is None or precision == "bf16"
                    else loglik_change(bf16, record, task)
                )
                if d is not None:
                    ref_exact = _scores(bf16, task)[1]
                    delta = mean_se(d)
                    below = f"{int((d < 0).sum())} of {d.size}"  # the mean's tails aside
                    changed = f"{int((exact < ref_exact).sum())} / {int((exact > ref_exact).sum())}"
                rows.append([
                    task.upper().replace("_", "-"), precision.upper(),
                    "—" if method is None else LABEL[method], f"{copied(record, task):.1f}",
                    f"{loglik.mean():.3f}", delta, below, changed,
                ])  # fmt: skip
    return rows


PATHS = (("c4r16", "the latent alone (C4R16)"), ("c16r4", "the RoPE key alone (C16R4)"),
         ("c4r4", "both (C4R4)"))  # fmt: skip


def path_rows(records: list[dict]) -> list[list[str]]:
    """Which path loses the answer: per method each path alone and both, the answer log-likelihood's
    change from BF16 (paired ± s.e.; the RoPE key alone per length too), both minus the sum of the
    two (do the losses add?), and QuantMLA − RTN per cache paired (`ruler_answer_paths`)."""
    found = cells(records)
    bf16 = found.get(("bf16", None))
    header = ["task", "method", *(label for _, label in PATHS), "both − the sum",
              "the RoPE key alone by length"]  # fmt: skip
    rows = [header]
    if bf16 is None:
        return rows
    lengths = bf16["config"]["eval"]["context_lengths"]
    for task in bf16["config"]["eval"]["tasks"]:
        changes: dict[str, dict] = {}
        for method in METHODS:
            d = {p: found.get((p, method)) for p, _ in PATHS}
            d = {p: r and loglik_change(bf16, r, task) for p, r in d.items()}
            if any(v is None for v in d.values()):
                continue
            changes[method] = d
            by_length = " / ".join(f"{x.mean():+.2f}" for x in np.split(d["c16r4"], len(lengths)))
            rows.append([
                task.upper().replace("_", "-"), LABEL[method], *(mean_se(d[p]) for p, _ in PATHS),
                mean_se(d["c4r4"] - d["c4r16"] - d["c16r4"]), f"{by_length} ({', '.join(map(str, lengths))})",
            ])  # fmt: skip
        if len(changes) == len(METHODS):
            gain = {p: changes["quantmla"][p] - changes["rtn"][p] for p, _ in PATHS}
            rows.append([
                task.upper().replace("_", "-"), "QuantMLA − RTN",
                *(f"{mean_se(gain[p])} ({int((gain[p] > 0).sum())} of {gain[p].size} higher)"
                  for p, _ in PATHS), "", "",
            ])  # fmt: skip
    return rows
