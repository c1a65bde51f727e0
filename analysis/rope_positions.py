"""Each method's RoPE-key positional QK error by key position, beside QuaRot†'s online Hadamard
(`python -m analysis.tables rope_positions`; the eval=rope_positions records of
experiment smol_rope_positions)."""

from __future__ import annotations

import numpy as np

LABELS = {"rtn": "RTN", "smoothquant": "SmoothQuant†", "quarot": "QuaRot† (online Hadamard)"}


def _label(config: dict) -> str:
    method = config["method"]["name"]
    if method != "quantmla":
        return LABELS.get(method, method)
    calibration = config["method"].get("calibration") or {}
    seqlen, positions = calibration.get("seqlen"), calibration.get("rope_positions", 0)
    if not seqlen:
        return "QuantMLA"
    moved = f" moved across 0–{positions - 1:,}" if positions else ""
    return f"QuantMLA (fitted on {seqlen:,}-token sequences{moved})"


def rope_position_rows(records: list[dict]) -> list[list[str]]:
    """One row per precision and method: the mean over layers of each key range's error, and in how
    many layers it is below QuaRot†'s at that precision."""
    cells: dict[tuple[str, str], tuple[str, dict]] = {}
    for r in records:
        if r["config"]["eval"]["kind"] != "rope_positions":
            continue
        key = (r["config"]["precision"]["name"], _label(r["config"]))
        if key not in cells or r.get("created", "") >= cells[key][0]:
            cells[key] = (r.get("created", ""), r["metrics"])
    if not cells:
        return [["no eval=rope_positions records"]]
    edges = next(iter(cells.values()))[1]["rope_positions/edges"]
    rows = [["precision", "cache", *(f"keys {a:,}–{b - 1:,}" for a, b in zip(edges, edges[1:]))]]
    order = [*LABELS.values()]
    for (precision, label), (_, m) in sorted(
        cells.items(),
        key=lambda kv: (kv[0][0], order.index(kv[0][1]) if kv[0][1] in order else 9, kv[0][1]),
    ):
        ours = np.asarray(m["rope_positions/qk_error"])
        reference = cells.get((precision, LABELS["quarot"]))
        row = [precision.upper(), label]
        for i, mean in enumerate(ours.mean(0)):
            below = ""
            if reference is not None and label != LABELS["quarot"]:
                theirs = np.asarray(reference[1]["rope_positions/qk_error"])[:, i]
                below = f" ({int((ours[:, i] < theirs).sum())} of {len(theirs)} below QuaRot†)"
            row.append(f"{mean:.3e}{below}")
        rows.append(row)
    return rows
