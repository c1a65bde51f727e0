"""QuantMLA's RoPE path fitted to its QK-score target (the paper's) or to the attention output
(`method.calibration.rope_objective=output`), or at the paper's 2,048 tokens, or on 512-token
sequences moved across positions 0–2,047 (`method.calibration.rope_positions=2048`), or with an
online Hadamard after its fitted pairs (`method.calibration.rope_hadamard=true`), beside QuaRot†'s
online Hadamard, on the SmolLM2-MLA perplexity records (`python -m analysis.tables
rope_objective`; campaign jobs 15, 28, 30, 33, 36, 58; the MXFP4 rows 21, 55, 56, 59)."""

from __future__ import annotations

import numpy as np

EXPERIMENTS = (
    "smol_table1", "smol_path_split", "smol_rope_objective", "smol_rope_seqlen", "smol_rope_moved",
    "smol_rope_hadamard",
)  # fmt: skip
MXFP4_EXPERIMENTS = ("smol_frontier", "smol_rope_hadamard")  # the MXFP4 cells (jobs 21, 55-56, 59)
ROWS = (  # method, RoPE objective, calibration seqlen, rope_positions, rope_hadamard, label
    ("quarot", "qk", None, 0, False, "QuaRot† (online Hadamard)"),
    ("quantmla", "qk", 512, 0, False, "QuantMLA, RoPE fitted to the QK scores (paper) on 512 tokens"),
    ("quantmla", "output", 512, 0, False, "QuantMLA, RoPE fitted to the attention output"),
    ("quantmla", "qk", 2048, 0, False, "QuantMLA, RoPE fitted to the QK scores on 2,048 tokens (32 + 8)"),
    ("quantmla", "qk", 512, 2048, False, "QuantMLA, RoPE fitted on 512 tokens moved across 0–2,047"),
    ("quantmla", "qk", 512, 0, True, "QuantMLA, its fitted pairs then an online Hadamard (ours)"),
)  # fmt: skip
MXFP4_ROWS = tuple(ROWS[i] for i in (0, 1, 5))  # the fits the MXFP4 caches have
PRECISIONS = {  # precision → (experiments read, rows shown)
    **{p: (EXPERIMENTS, ROWS) for p in ("c16r4", "c4r4", "c2r4")},
    **{p: (MXFP4_EXPERIMENTS, MXFP4_ROWS) for p in ("c16rmxfp4", "cmxfp4rmxfp4")},
}


def _variant(record: dict) -> tuple:
    c = record["config"]
    calibration = c["method"].get("calibration") or {}
    calibrated = c["method"]["name"] == "quantmla"
    seqlen = calibration.get("seqlen") if calibrated else None
    return (
        c["precision"]["name"], c["method"]["name"], calibration.get("rope_objective", "qk"),
        seqlen, calibration.get("rope_positions", 0),
        calibrated and calibration.get("rope_hadamard", False),
    )  # fmt: skip


def rope_objective_rows(records: list[dict]) -> list[list[str]]:
    cells: dict[tuple, tuple[str, dict]] = {}
    for r in records:
        c = r["config"]
        if r.get("experiment") not in EXPERIMENTS + MXFP4_EXPERIMENTS:
            continue
        read = PRECISIONS.get(c["precision"]["name"], ((), ()))[0]
        if r["experiment"] not in read or c["model"]["name"] != "smol_mla":
            continue
        if c["eval"]["kind"] != "perplexity" or "nmse/attn_layers" not in r["metrics"]:
            continue
        key = _variant(r)
        if key not in cells or r.get("created", "") >= cells[key][0]:
            cells[key] = (r.get("created", ""), r["metrics"])
    header = ["precision", "cache", "WikiText-2 ppl", "C4 ppl", "attn-output NMSE",
              "layers below QuaRot†"]  # fmt: skip
    rows = [header]
    for precision, (_, shown) in PRECISIONS.items():
        reference = cells.get((precision, "quarot", "qk", None, 0, False))
        for *variant, label in shown:
            found = cells.get((precision, *variant))
            if found is None:
                rows.append([precision.upper(), label, "—", "—", "—", "—"])
                continue
            m = found[1]
            below = "—"
            if reference is not None and variant[0] != "quarot":
                ours, theirs = (np.asarray(x["nmse/attn_layers"]) for x in (m, reference[1]))
                below = f"{int((ours < theirs).sum())} of {len(ours)}"
            rows.append([
                precision.upper(), label, f"{m['ppl/wikitext2']:.3f}", f"{m['ppl/c4']:.3f}",
                f"{m['nmse/attn_mean']:.3e}", below,
            ])  # fmt: skip
    return rows
