"""RULER S-NIAH answers teacher-forced through each cache (eval=ruler_answer): per task, each cell's
whole-answer argmax rate and mean answer log-likelihood, and its change from BF16 paired over the
same samples (`python -m analysis.tables ruler_answer`; experiment smol_ruler_answer)."""

from __future__ import annotations

import math

import numpy as np

PRECISIONS = ("bf16", "c4r4", "c4r16", "c16r4")
METHODS = ("rtn", "quantmla")
LABEL = {"rtn": "RTN", "quantmla": "QuantMLA"}


def _samples(metrics: dict, task: str, lengths: list[int], name: str) -> np.ndarray:
    return np.concatenate(
        [np.asarray(metrics[f"docs/ruler_answer/{task}/{n}/{name}"], float) for n in lengths]
    )


def answer_rows(records: list[dict]) -> list[list[str]]:
    cells: dict[tuple, tuple[str, dict]] = {}
    for r in records:
        c = r["config"]
        if c["eval"]["kind"] != "ruler_answer":
            continue
        method = None if c["precision"]["name"] == "bf16" else c["method"]["name"]
        key = (c["precision"]["name"], method)
        if key not in cells or r.get("created", "") >= cells[key][0]:
            cells[key] = (r.get("created", ""), r)
    header = ["task", "precision", "method", "answers copied (%)", "answer log-lik (nats)",
              "Δ log-lik vs BF16 (paired ± s.e.)", "log-lik below BF16", "copied: lost / gained vs BF16"]  # fmt: skip
    rows = [header]
    bf16 = cells.get(("bf16", None))
    tasks = sorted({t for _, r in cells.values() for t in r["config"]["eval"]["tasks"]})
    for task in tasks:
        for precision in PRECISIONS:
            for method in (None,) if precision == "bf16" else METHODS:
                found = cells.get((precision, method))
                if found is None or task not in found[1]["config"]["eval"]["tasks"]:
                    continue
                record = found[1]
                m, lengths = record["metrics"], record["config"]["eval"]["context_lengths"]
                loglik, exact = (_samples(m, task, lengths, n) for n in ("loglik", "exact"))
                delta = below = changed = "—"
                if bf16 is not None and precision != "bf16":
                    ref = bf16[1]["metrics"]
                    ref_loglik, ref_exact = (
                        _samples(ref, task, lengths, n) for n in ("loglik", "exact")
                    )
                    if ref_loglik.size == loglik.size:
                        d = loglik - ref_loglik
                        delta = f"{d.mean():+.3f} ± {d.std(ddof=1) / math.sqrt(d.size):.3f}"
                        below = f"{int((d < 0).sum())} of {d.size}"  # the mean's tails aside
                        changed = (
                            f"{int((exact < ref_exact).sum())} / {int((exact > ref_exact).sum())}"
                        )
                rows.append([
                    task.upper().replace("_", "-"), precision.upper(),
                    "—" if method is None else LABEL[method], f"{100 * exact.mean():.1f}",
                    f"{loglik.mean():.3f}", delta, below, changed,
                ])  # fmt: skip
    return rows
