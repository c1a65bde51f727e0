"""analysis/frontier.py on synthetic records: Δ perplexity, paired spreads, the predictor's sums and
rank agreement, the pairs each mixed cache is compared with, and the figure."""

import math

import numpy as np
import pytest

from analysis import frontier

CANDIDATES = ["c2r4", "c4r4", "bf16"]
ERRORS = [[4.0, 1.0, 0.0], [2.0, 0.5, 0.0]]  # (2 layers, 3 candidates)
BYTES = {"c2r4": 120, "c4r4": 184, "bf16": 640}
BYTES |= {"c16re4m3t": 576, "cnvfp4r16": 272, "clm4r16": 258, "ce4m3r16": 400}


def record(
    name,
    method="rtn",
    nll=(1.0, 1.2, 0.8),
    nmse=None,
    layers=None,
    budget=None,
    errors=ERRORS,
    error_model=None,
):
    layer_formats = layers or [name] * 2
    packed = sum(BYTES[f] for f in layer_formats) / 2
    metrics = {
        "ppl/wikitext2": math.exp(np.mean(nll)),
        "nll_windows/wikitext2": list(nll),
        "cache/bytes_per_token": packed,
        "cache/bytes_per_token_protected": packed + 10,
        "cache/protected_at": 2048,
    }
    if nmse is not None:
        metrics["nmse/attn_mean"] = nmse
    precision = {"name": name, "sink": 4, "recent": 128, "group_size": 64}
    if name == "mixed":
        precision["budget_bytes"] = budget
        if error_model:
            precision["allocation_error"] = error_model
        metrics |= {
            "allocation/precisions": layers,
            "allocation/candidates": CANDIDATES,
            "allocation/predicted_errors": errors,
        }
    return {
        "config": {
            "eval": {"kind": "perplexity", "datasets": ["wikitext2"]},
            "precision": precision,
            "method": {"name": method},
            "model": {"name": "tiny_mla_v2"},
        },
        "metrics": metrics,
    }


RECORDS = [
    record("bf16", nll=(1.0, 1.2, 0.8)),
    record("c2r4", nll=(1.1, 1.25, 0.9), nmse=3e-2),
    record("c4r4", nll=(1.01, 1.21, 0.805), nmse=2e-3),
    record("mixed", nll=(1.05, 1.22, 0.82), nmse=1e-2, layers=["c4r4", "c2r4"], budget=152),
]


def test_rows_deltas_and_predictions():
    q_errors = [[1.0, 0.5, 0.0], [3.0, 0.2, 0.0]]  # measured after QuantMLA's transforms
    quantmla = [
        record("c2r4", "quantmla", nmse=5e-3),
        record(
            "mixed", "quantmla", nmse=4e-3, layers=["c4r4", "c2r4"], budget=152,
            errors=q_errors, error_model="output",
        ),
    ]  # fmt: skip
    rows = frontier.frontier_rows(RECORDS + quantmla)
    # each method's rows are predicted from its own mixed record's errors, per error model:
    # QuantMLA's output model 1 + 3, then 0.5 + 3; it has no R × NMSE record
    q_rows = [r for r in rows[1:] if r[0] == "quantmla"]
    assert [r[1] for r in q_rows] == ["c2r4", "mixed@152 (output)"]
    assert [r[7] for r in q_rows] == ["4.00e+00", "3.50e+00"] and {r[6] for r in q_rows} == {"—"}
    by_cache = {r[1]: r for r in rows[1:] if r[0] != "quantmla"}
    assert set(by_cache) == {"bf16", "c2r4", "c4r4", "mixed@152 (R × NMSE)"}
    assert by_cache["c2r4"][4].endswith(f"({100 * (math.exp((0.1 + 0.05 + 0.1) / 3) - 1):+.2f} %)")
    # predicted Σ NMSE: uniform c2r4 4 + 2, mixed c4r4 then c2r4: 1 + 2
    assert by_cache["c2r4"][6] == "6.00e+00" and by_cache["mixed@152 (R × NMSE)"][6] == "3.00e+00"
    assert by_cache["mixed@152 (R × NMSE)"][2] == "152"


def test_paired_spread_is_the_standard_error_of_window_differences():
    pts = {p.cache: p for p in frontier.points(RECORDS)}
    delta, se = frontier.paired(pts["mixed@152 (R × NMSE)"], pts["c2r4"], "wikitext2")
    d = np.array([1.05, 1.22, 0.82]) - np.array([1.1, 1.25, 0.9])
    assert delta == pytest.approx(100 * d.mean())
    assert se == pytest.approx(100 * d.std(ddof=1) / math.sqrt(3))


def test_pairs_and_rank_agreement():
    rows = frontier.comparison_rows(RECORDS)
    pairs = [(r[1], r[2]) for r in rows[1:] if r[1].startswith("mixed")]
    # the mixed cache at 152 B against the cheapest uniform format above its budget (no 152 B one)
    assert pairs == [("mixed@152 (R × NMSE), 152 B", "c4r4, 184 B")]
    # then the compared uniform cache against BF16: its headroom (+1, +1, +0.5 % of log ppl)
    headroom = [r for r in rows[1:] if r[2] == "bf16, 640 B"]
    assert [r[1] for r in headroom] == ["c4r4, 184 B"]
    assert headroom[0][3].startswith(f"{100 * np.mean([0.01, 0.01, 0.005]):+.3f} ± ")
    # a joint-checked allocation is its own row
    joint = record("mixed", nll=(1.0, 1.2, 0.8), layers=["c4r4", "c2r4"], budget=152)
    joint["config"]["precision"]["joint_top"] = 16
    assert "mixed@152 (R × NMSE, joint 16)" in {p.cache for p in frontier.points([joint])}
    # one chosen among fewer candidates says which it could not take
    narrow = record("mixed", nll=(1.0, 1.2, 0.8), layers=["c4r4", "c4r4"], budget=152)
    narrow["metrics"]["allocation/candidates"] = ["c4r4", "bf16"]
    labels = {p.cache for p in frontier.points([RECORDS[-1], narrow])}
    assert labels == {"mixed@152 (R × NMSE)", "mixed@152 (R × NMSE, without c2r4)"}
    assert rows[-1][2] == "Spearman 1.000" and rows[-1][3] == "3 caches"


def test_a_frontier_needs_its_bf16_record():
    with pytest.raises(SystemExit, match="BF16"):
        frontier.frontier_rows(RECORDS[1:])


def test_per_path_diagnostics_are_the_one_path_caches_no_engine_lays_out():
    names = ["c16re4m3t", "cnvfp4r16", "clm4r16", "ce4m3r16", "c2r4", "bf16"]
    pts = frontier.points([record(n) for n in names] + [RECORDS[-1]])
    diagnostic = {p.cache for p in pts if p.per_path}
    assert diagnostic == {"c16re4m3t", "cnvfp4r16"}  # TurboQuant's and fp8_ds_mla's keep BF16 keys


def test_figure_is_drawn(tmp_path):
    paths = frontier.frontier(RECORDS, tmp_path, "frontier")
    assert {p.suffix for p in paths} == {".png", ".pdf"} and all(p.stat().st_size for p in paths)
