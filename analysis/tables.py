"""Regenerate a table from the results store.

    python -m analysis.tables tiny_methods [--results results] [--out docs/tables]

`tiny_methods`: the tiny model's precision × method table (perplexities and mean per-layer
attention-output NMSE). Rows come only from result records; a missing cell shows "—"; the best
quantized value per precision and column is bold (BF16 excluded from bolding).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantmla.tracking.store import load_records

METHOD_ORDER = ("rtn", "smoothquant", "quarot", "quantmla")
METHOD_LABEL = {
    "rtn": "RTN",
    "smoothquant": "SmoothQuant†",
    "quarot": "QuaRot†",
    "quantmla": "QuantMLA",
}
COLUMNS = (
    ("ppl/wikitext2", "WikiText-2 ppl", "{:.3f}"),
    ("ppl/c4", "C4 ppl", "{:.3f}"),
    ("nmse/attn_mean", "attn-output NMSE", "{:.3e}"),
)


def method_table(records: list[dict]) -> str:
    """Markdown: BF16, then each precision's methods; lower is better in every column."""
    cells: dict[tuple[str, str], dict] = {}
    for r in records:
        cells[(r["config"]["precision"]["name"], r["config"]["method"]["name"])] = r["metrics"]
    precisions = sorted(
        {p for p, _ in cells if p != "bf16"}, key=lambda p: (-int(p[1 : p.index("r")]), p)
    )
    lines = [
        "| precision | method | " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|" + "---|" * (2 + len(COLUMNS)),
    ]
    bf16 = next((m for (p, _), m in cells.items() if p == "bf16"), None)
    if bf16 is not None:
        lines.append(
            "| BF16 | — | " + " | ".join(_fmt(bf16.get(k), f) for k, _, f in COLUMNS) + " |"
        )
    for precision in precisions:
        best = {}
        for key, _, fmt in COLUMNS:
            values = [cells.get((precision, m), {}).get(key) for m in METHOD_ORDER]
            shown = [fmt.format(v) for v in values if v is not None]
            best[key] = min(shown, key=float) if shown else None
        for method in METHOD_ORDER:
            metrics = cells.get((precision, method), {})
            row = []
            for key, _, fmt in COLUMNS:
                text = _fmt(metrics.get(key), fmt)
                row.append(
                    f"**{text}**" if text == best[key] else text
                )  # ties at display precision all bold
            lines.append(
                f"| {precision.upper()} | {METHOD_LABEL[method]} | " + " | ".join(row) + " |"
            )
    return "\n".join(lines)


def _fmt(value, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


TABLES = {"tiny_methods": ("tiny_methods", method_table)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("--results", default="results")
    parser.add_argument("--out", default=None, help="also write <out>/<table>.md")
    args = parser.parse_args()
    experiment, build = TABLES[args.table]
    text = build(load_records(args.results, experiment))
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.table}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
