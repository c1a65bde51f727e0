"""QuantMLA's RoPE path fitted to its QK-score target (the paper's) or to the attention output
(`method.calibration.rope_objective=output`), or at the paper's 2,048 tokens, or on 512-token
sequences moved across positions 0–2,047 (`method.calibration.rope_positions=2048`), beside
QuaRot†'s online Hadamard, on the SmolLM2-MLA perplexity records (`python -m analysis.tables
rope_objective`; campaign jobs 15, 28, 30, 33, 36)."""

from __future__ import annotations

import numpy as np

EXPERIMENTS = (
    "smol_table1", "smol_path_split", "smol_rope_objective", "smol_rope_seqlen", "smol_rope_moved",
)  # fmt: skip
PRECISIONS = ("c16r4", "c4r4", "c2r4")
ROWS = (  # method, RoPE objective, calibration seqlen, rope_positions, label
    ("quarot", "qk", None, 0, "QuaRot† (online Hadamard)"),
    ("quantmla", "qk", 512, 0, "QuantMLA, RoPE fitted to the QK scores (paper) on 512 tokens"),
    ("quantmla", "output", 512, 0, "QuantMLA, RoPE fitted to the attention output"),
    ("quantmla", "qk", 2048, 0, "QuantMLA, RoPE fitted to the QK scores on 2,048 tokens (32 + 8)"),
    ("quantmla", "qk", 512, 2048, "QuantMLA, RoPE fitted on 512 tokens moved across 0–2,047"),
)


def _variant(record: dict) -> tuple:
    c = record["config"]
    calibration = c["method"].get("calibration") or {}
    seqlen = calibration.get("seqlen") if c["method"]["name"] == "quantmla" else None
    return (
        c["precision"]["name"], c["method"]["name"], calibration.get("rope_objective", "qk"),
        seqlen, calibration.get("rope_positions", 0),
    )  # fmt: skip


def rope_objective_rows(records: list[dict]) -> list[list[str]]:
    cells: dict[tuple, tuple[str, dict]] = {}
    for r in records:
        c = r["config"]
        if r.get("experiment") not in EXPERIMENTS or c["model"]["name"] != "smol_mla":
            continue
        if c["eval"]["kind"] != "perplexity" or "nmse/attn_layers" not in r["metrics"]:
            continue
        key = _variant(r)
        if key not in cells or r.get("created", "") >= cells[key][0]:
            cells[key] = (r.get("created", ""), r["metrics"])
    header = ["precision", "cache", "WikiText-2 ppl", "C4 ppl", "attn-output NMSE",
              "layers below QuaRot†"]  # fmt: skip
    rows = [header]
    for precision in PRECISIONS:
        reference = cells.get((precision, "quarot", "qk", None, 0))
        for method, objective, seqlen, positions, label in ROWS:
            found = cells.get((precision, method, objective, seqlen, positions))
            if found is None:
                rows.append([precision.upper(), label, "—", "—", "—", "—"])
                continue
            m = found[1]
            below = "—"
            if reference is not None and method != "quarot":
                ours, theirs = (np.asarray(x["nmse/attn_layers"]) for x in (m, reference[1]))
                below = f"{int((ours < theirs).sum())} of {len(ours)}"
            rows.append([
                precision.upper(), label, f"{m['ppl/wikitext2']:.3f}", f"{m['ppl/c4']:.3f}",
                f"{m['nmse/attn_mean']:.3e}", below,
            ])  # fmt: skip
    return rows
