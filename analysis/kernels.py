"""The kernels' ahead-of-time compile table (issue #32) from `results/kernels_compile.json`
(`make kernels-compile`): per kernel and arch the specialisations the GPU paths launch and the
worst resources among them, then every hot decode configuration on its own row. Written to
docs/tables/ and into the `<!-- generated: kernels_compile -->` block of docs/packed-cache.md.

    python -m analysis.kernels [results/kernels_compile.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis.tables import embed_in_docs, to_markdown

NAME = "kernels_compile"
SHOWN = ("BLOCK_H", "TILE", "PAGE", "BLOCK_S")  # the launch-shape constexprs a reader compares


def summary_rows(report: dict) -> list[list[str]]:
    rows = [[
        "kernel", "arch", "specialisations", "paths", "registers (max)", "spill st/ld (max, instr.)",
        "shared (max, KB)", "blocks/SM (min)", "cubin (max, KB)", "failing",
    ]]  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for e in report["entries"]:
        groups.setdefault((e["kernel"], e["arch"]), []).append(e)
    for (kernel, arch), entries in sorted(groups.items()):
        ok = [e for e in entries if "error" not in e]
        paths = sorted({p for e in entries for p in e["paths"]})
        rows.append([
            kernel, f"sm_{arch}", str(len(entries)), ", ".join(paths),
            str(max((e["registers"] for e in ok), default=0)),
            f"{max((e['spill_stores'] for e in ok), default=0)} / "
            f"{max((e['spill_loads'] for e in ok), default=0)}",
            f"{max((e['shared_bytes'] for e in ok), default=0) / 1024:.1f}",
            str(min((e["blocks_per_sm"] for e in ok), default=0)),
            f"{max((e['cubin_bytes'] for e in ok), default=0) / 1024:.1f}",
            str(sum(1 for e in entries if e["problems"])),
        ])  # fmt: skip
    return rows


def hot_rows(report: dict) -> list[list[str]]:
    rows = [[
        "formats", "d_c", "page", "launch shape", "warps", "arch", "registers", "spill st/ld (instr.)",
        "shared (KB)", "blocks/SM", "cubin (KB)",
    ]]  # fmt: skip
    for e in report["entries"]:
        if not e["hot"] or "error" in e:
            continue
        shape = ", ".join(f"{k} {e['constexprs'][k]}" for k in SHOWN if k in e["constexprs"])
        rows.append([
            ", ".join(e["formats"]), ", ".join(map(str, e["d_c"])),
            ", ".join(map(str, e["page"])), shape, str(e["num_warps"]), f"sm_{e['arch']}",
            str(e["registers"]), f"{e['spill_stores']} / {e['spill_loads']}",
            f"{e['shared_bytes'] / 1024:.1f}", str(e["blocks_per_sm"]),
            f"{e['cubin_bytes'] / 1024:.1f}",
        ])  # fmt: skip
    return rows


def markdown(report: dict) -> str:
    head = (
        f"{report['specialisations']} specialisations (from {report['recorded_launches']} "
        f"recorded launches) x {len(report['archs'])} archs, Triton {report['triton']}; "
        f"{len(report['failures'])} failing.\n\n"
    )
    return (head + to_markdown(summary_rows(report)) + "\n\nThe decode kernel as serving and the "
            "packed cache launch it (must not spill):\n\n" + to_markdown(hot_rows(report)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", nargs="?", default="results/kernels_compile.json")
    parser.add_argument("--out", default="docs/tables")
    args = parser.parse_args()
    path = Path(args.report)
    if not path.is_file():
        sys.exit(
            f"error: {path} is missing; run `make kernels-compile` first (nothing was written)"
        )
    text = markdown(json.loads(path.read_text()))
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.md").write_text(text + "\n")
    for page in embed_in_docs(NAME, text, out.parent):
        print(f"updated {page}")


if __name__ == "__main__":
    main()
