"""The SmolLM2-MLA testbed's tables (docs/testbeds.md, docs/results.md), from records only:
the source / converted / published rows (`smol_testbed`), the cache's outlier statistic beside
tiny-mla-v2's (`smol_outliers`), and RTN's cost with and without protection (`smol_rtn_cost`)."""

from __future__ import annotations

import math

ROWS = (
    ("source", "SmolLM2-135M-Instruct (Llama, GQA; the source)"),
    ("converted", "converted to MLA, before healing"),
    ("published", "**SmolLM2-MLA (published testbed)**"),
)
TASK_HEADERS = {"hellaswag": "HellaSwag", "piqa": "PIQA", "arc_easy": "ARC-e", "arc_challenge": "ARC-c", "winogrande": "WinoGrande"}  # fmt: skip


def _by(records: list[dict], row: str, kind: str) -> dict | None:
    found = [
        r
        for r in records
        if r["config"]["model"].get("row") == row and r["config"]["eval"]["kind"] == kind
    ]
    size = lambda r: r["metrics"].get("windows/wikitext2", 0)  # noqa: E731  (perplexity: most windows)
    return max(found, key=lambda r: (size(r), r.get("created", ""))) if found else None


def _common_delta(m: dict, base: dict, dataset: str) -> str:
    """`m`'s perplexity and its change vs the source on the windows both measured (per-window NLLs
    are in both records; a shorter source run compares on its windows, said so)."""
    value = m[f"ppl/{dataset}"]
    mine, theirs = m.get(f"nll_windows/{dataset}"), base.get(f"nll_windows/{dataset}")
    if not mine or not theirs:
        return _delta(value, base.get(f"ppl/{dataset}"))
    n = min(len(mine), len(theirs))
    change = 100 * (math.exp(sum(mine[:n]) / n - sum(theirs[:n]) / n) - 1)
    where = "" if n == len(mine) == len(theirs) else f" on the first {n}"
    return f"{value:.2f} ({change:+.1f} %{where})"


def _delta(value: float, base: float | None) -> str:
    if base is None:
        return f"{value:.2f}"
    return f"{value:.2f} ({100 * (value / base - 1):+.1f} %)"


def testbed_rows(records: list[dict]) -> list[list[str]]:
    """Perplexity (2,048-token windows from the start of each set, their count shown; change vs the
    source, which must be measured on the same windows) and the five 0-shot tasks."""
    done = [r for r in records if r["config"]["eval"]["kind"] == "commonsense"]
    tasks = done[0]["config"]["eval"]["tasks"] if done else list(TASK_HEADERS)
    header = [
        "model",
        "WikiText-2 ppl",
        "C4 ppl",
        "windows",
        *(TASK_HEADERS.get(t, t) for t in tasks),
        "avg",
    ]
    source = _by(records, "source", "perplexity")
    base = source["metrics"] if source else {}
    rows = [header]
    for row, label in ROWS:
        ppl, scored = _by(records, row, "perplexity"), _by(records, row, "commonsense")
        cells = [label]
        for dataset in ("wikitext2", "c4"):
            if ppl is None:
                cells.append("—")
                continue
            if row == "source" or not base:
                cells.append(f"{ppl['metrics'][f'ppl/{dataset}']:.2f}")
            else:
                cells.append(_common_delta(ppl["metrics"], base, dataset))
        m = ppl["metrics"] if ppl else {}
        cells.append(f"{m['windows/wikitext2']} + {m['windows/c4']}" if ppl else "—")
        for task in tasks:
            m = scored["metrics"] if scored else {}
            value, err = m.get(f"acc/{task}"), m.get(f"acc_stderr/{task}")
            cells.append(
                "—" if value is None else f"{value:.1f} ± {err:.1f}" if err else f"{value:.1f}"
            )
        cells.append(f"{scored['metrics']['acc/avg']:.1f}" if scored else "—")
        rows.append(cells)
    return rows


def outlier_rows(records: list[dict]) -> list[list[str]]:
    """Per-channel absmax max/median of the cached c and k_R (median over layers, and the largest)."""
    rows = [["model", "layers", "c: median", "c: max", "k_R: median", "k_R: max"]]
    labels = {"tiny_mla_v2": "tiny-mla-v2 (trained here)", "converted": "SmolLM2-MLA before healing", "published": "SmolLM2-MLA (published)"}  # fmt: skip
    for row, label in labels.items():
        r = _by(records, row, "outliers")
        if r is None:
            continue
        m = r["metrics"]
        rows.append(
            [
                label,
                str(len(m["outliers/c/per_layer"])),
                f"{m['outliers/c/median']:.2f}",
                f"{m['outliers/c/max']:.2f}",
                f"{m['outliers/k_r/median']:.2f}",
                f"{m['outliers/k_r/max']:.2f}",
            ]
        )
    return rows


def rtn_cost_rows(records: list[dict]) -> list[list[str]]:
    """RTN per precision, with (sink + recent in BF16) and without protection, against BF16."""
    header = ["precision", "protection", "WikiText-2 ppl", "C4 ppl", "attn-output NMSE", "windows"]
    bf16 = [r for r in records if r["config"]["precision"]["name"] == "bf16"]
    base = bf16[0]["metrics"] if bf16 else {}
    rows = [header]

    def order(r):
        p = r["config"]["precision"]
        return (p["name"] != "bf16", -int(p["name"][1]) if p["name"] != "bf16" else 0, -p["sink"])

    for r in sorted(records, key=order):
        p, m = r["config"]["precision"], r["metrics"]
        protection = (
            "—"
            if p["name"] == "bf16"
            else f"sink {p['sink']} + recent {p['recent']}"
            if p["sink"] or p["recent"]
            else "none"
        )
        cells = [p["name"].upper(), protection]
        for dataset in ("wikitext2", "c4"):
            value = m.get(f"ppl/{dataset}")
            ref = None if p["name"] == "bf16" else base.get(f"ppl/{dataset}")
            cells.append("—" if value is None else _delta(value, ref))
        nmse = m.get("nmse/attn_mean")
        cells.append("—" if nmse is None else f"{nmse:.3e}")
        cells.append(str(m.get("windows/wikitext2", "—")))
        rows.append(cells)
    return rows
