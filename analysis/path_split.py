"""Whether a cache's two paths add up: each method's C2R4 (C4R4) cell against its INT2 (INT4)
latent alone (C2R16, C4R16) and its INT4 RoPE key alone (C16R4) on SmolLM2-MLA, as the interaction
CxR4 − CxR16 − C16R4 + BF16 of each measure, paired per window or document where the records
keep them (`python -m analysis.tables path_interaction`; campaign jobs 4, 28, 60, 62-64 and 67).
Positive: both paths quantized cost more than the two alone add up to."""

from __future__ import annotations

import numpy as np

from analysis.common import mean_se, method_variant
from quantmla.methods.registry import METHODS

MODEL = "smol_mla"
EXPERIMENTS = ("smol_table1", "smol_path_split", "smol_path_split_gsm8k", "smol_gsm8k_drawn")
# each cache with both paths quantized → (its latent alone, its RoPE key alone)
SPLITS = {"c2r4": ("c2r16", "c16r4"), "c4r4": ("c4r16", "c16r4")}
# (metric, header, scale, format): per-window NLLs (their mean is ln ppl, so the interaction in
# ln ppl × 100 is ~% of perplexity), per-document bits/byte, and each record's NMSE by the
# dataset of its NMSE windows (a perplexity job's first)
MEASURES = (
    ("nll_windows/wikitext2", "WikiText-2 ppl (Δ ln × 100)", 100, "{:+.2f} ± {:.2f}"),
    ("nll_windows/c4", "C4 ppl (Δ ln × 100)", 100, "{:+.2f} ± {:.2f}"),
    ("nll_windows/gsm8k", "GSM8K text ppl (Δ ln × 100)", 100, "{:+.2f} ± {:.2f}"),
    ("docs/gsm8k_reference", "GSM8K ref. bits/byte", 1, "{:+.4f} ± {:.4f}"),
    ("docs/gsm8k_reference_drawn", "GSM8K ref. bits/byte, drawn shots", 1, "{:+.4f} ± {:.4f}"),
    ("nmse/wikitext2", "attn-output NMSE, WikiText-2", 1, "{:+.2e}"),
    ("nmse/gsm8k", "attn-output NMSE, GSM8K text", 1, "{:+.2e}"),
)


def cells_of(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(precision, method) → the measures its records hold (the latest record of each wins; the
    BF16 cell is RTN's, which quantizes nothing)."""
    cells: dict[tuple[str, str], dict] = {}
    for r in sorted(records, key=lambda r: r.get("created", "")):
        c, m = r["config"], r["metrics"]
        if r.get("experiment") not in EXPERIMENTS or c["model"]["name"] != MODEL:
            continue
        if method_variant(c["method"]) != c["method"]["name"]:  # an extension's variant
            continue
        found = {k: m[k] for k, *_ in MEASURES if k in m}
        if "nmse/attn_mean" in m and c["eval"]["kind"] == "perplexity":
            found[f"nmse/{c['eval']['datasets'][0]}"] = m["nmse/attn_mean"]
        cells.setdefault((c["precision"]["name"], c["method"]["name"]), {}).update(found)
    return cells


def interaction(both, content, rope, bf16) -> tuple[float, float | None, float]:
    """CxR4 − CxR16 − C16R4 + BF16: its mean, standard error over the paired items (None for one
    value a cell) and the two paths' summed change from BF16 (for its share)."""
    both, content, rope, bf16 = (
        np.atleast_1d(np.asarray(v, float)) for v in (both, content, rope, bf16)
    )
    excess = both - content - rope + bf16
    paths = float((content + rope - 2 * bf16).mean())
    if excess.size < 2:
        return float(excess.mean()), None, paths
    mean, se = mean_se(excess)
    return mean, se, paths


def measured(cells: dict, both: str, method: str, metric: str):
    """The interaction of `metric` for `method`'s `both` cache as `interaction` gives it; None
    where a cell lacks the metric or the cells hold different windows or documents."""
    values = [cells.get((p, method), {}).get(metric) for p in (both, *SPLITS[both])]
    bf16 = 0.0 if metric.startswith("nmse/") else cells.get(("bf16", "rtn"), {}).get(metric)
    if any(v is None for v in (*values, bf16)):
        return None
    if len({np.size(v) for v in (*values, bf16)} - {1}) > 1:  # different windows or documents
        return None
    return interaction(*values, bf16)


def _shown(cells: dict, both: str, method: str, metric: str, scale: float, fmt: str) -> str:
    found = measured(cells, both, method, metric)
    if found is None:
        return "—"
    mean, se, paths = found
    text = fmt.format(scale * mean) if se is None else fmt.format(scale * mean, scale * se)
    return text + (f" ({100 * mean / paths:+.0f} %)" if paths else "")  # of the paths' sum


def interaction_rows(records: list[dict]) -> list[list[str]]:
    cells = cells_of(records)
    rows = [["method", "cache", *(header for _, header, *_ in MEASURES)]]
    for both in SPLITS:
        for method in METHODS:
            if any((p, method) in cells for p in (both, *SPLITS[both])):
                shown = [_shown(cells, both, method, k, s, fmt) for k, _, s, fmt in MEASURES]
                if any(v != "—" for v in shown):
                    rows.append([METHODS[method].label, both.upper(), *shown])
    return rows
