"""Regenerate a paper table from the results store (or W&B with --source wandb), in the paper's
layout: models × precisions × methods, suite averages with equal weight per benchmark, the best
quantized value per model/precision/column in bold (BF16 never bold; ties at display precision all
bold), "—" for a missing cell (never zero), and the paper's own numbers beside ours where stated.

    python -m analysis.tables tiny_table1 | smol_table1   # Markdown to stdout, Markdown + LaTeX to docs/tables/
    python -m analysis.tables table1 --source wandb --project quantmla
    python -m analysis.tables table4 [--experiment tiny_fig2_sensitivity]   # sensitivity aggregates
    python -m analysis.tables table5 | table6 [--experiment tiny_table5_probes]   # operator analysis
    python -m analysis.tables frontier | frontier_pairs [--experiment tiny_frontier]   # issue #23
    python -m analysis.tables smol_testbed | smol_outliers | smol_rtn_cost              # issue #39
    python -m analysis.tables smol_path_split    # the C2R4 baselines per path (issue #40)
    python -m analysis.tables smol_path_split_gsm8k   # ... on GSM8K's question-and-answer text
    python -m analysis.tables path_interaction   # do the two paths' errors add up (C2R4 vs each alone)
    python -m analysis.tables smol_fig4_ruler    # RULER S-NIAH per context length (Fig. 4 twin)
    python -m analysis.tables layer_nmse --experiment smol_table1   # per-layer attention-output NMSE
    python -m analysis.tables rope_objective     # QuantMLA's RoPE path fitted to QK scores or output
    python -m analysis.tables rope_positions     # the RoPE key's QK error by key position
    python -m analysis.tables ruler_answer       # RULER answers teacher-forced, paired vs BF16
    python -m analysis.tables ruler_answer_paths # ... per path: which one loses the answer
    python -m analysis.tables claims             # the paper's claims on each testbed (issue #40)
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from analysis import (
    claims,
    costs,
    frontier,
    layer_nmse,
    path_split,
    probes,
    rope_objective,
    rope_positions,
    ruler_answer,
    sensitivity,
    testbed,
    throughput,
)
from analysis.common import (
    add_wandb_arguments,
    changed_documents,
    default_results_dir,
    method_variant,
    output_name,
    paired_change,
    wandb_logger,
)
from quantmla.evaluation.lm_eval.suites import TASKS
from quantmla.methods.registry import METHODS
from quantmla.tracking.store import load_records

METHOD_ORDER = tuple(METHODS)
METHOD_LABEL = {name: m.label for name, m in METHODS.items()}
PRECISION_ORDER = ("bf16", "c4r4", "c2r4", "c4r16", "c8r8")
PAPER_PRECISIONS = ("c4r4", "c2r4")  # Table 1's rows: every method listed
PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.yaml")


@dataclass(frozen=True)
class Column:
    metric: str  # key in the record's metrics
    header: str
    fmt: str = "{:.2f}"
    higher_is_better: bool = True
    paper_key: str | None = None  # key in paper_numbers.yaml
    stderr: str | None = None  # metric shown as "± stderr" beside the value

    def show(self, metrics: dict) -> tuple[str | None, str]:
        """(value as displayed, suffix); the value alone decides bold."""
        value = metrics.get(self.metric)
        if value is None:
            return None, ""
        err = metrics.get(self.stderr) if self.stderr else None
        shown_err = "" if err is None else f" ± {self.fmt.replace('+', '').format(err)}"
        return self.fmt.format(value), shown_err


@dataclass(frozen=True)
class Layout:
    experiment: str
    columns: tuple[Column, ...]
    average: tuple[str, ...] = ()  # metrics whose equal-weight average is appended as "Avg"
    paper_table: str | None = None
    also: tuple[str, ...] = ()  # other experiments whose records join this table's
    precisions: tuple[str, ...] | None = None  # rows of these precisions only (None: all)
    per_length: bool = False  # metrics keyed `<metric>@<model.eval_seqlen>`: one column per length
    changed: tuple[str, ...] = ()  # tasks whose per-document scores are compared with BF16's
    paired: tuple[str, ...] = ()  # tasks whose per-document change from BF16 is a column (PAIRED)
    paper_model: str | None = None  # the paper's model whose numbers stand beside a testbed's


def _task_columns(tasks, stderr: bool = False):
    return tuple(
        Column(
            f"acc/{t}",
            TASKS[t].label,
            "{:.2f}" if TASKS[t].percent else "{:.4f}",
            TASKS[t].higher_is_better,
            t,
            f"acc_stderr/{t}" if stderr else None,
        )
        for t in tasks
    )


PAIRED = "paired"  # metrics paired/<task>, paired_se/<task>: a cell's per-document change from BF16


def _paired_columns(tasks):
    return tuple(
        Column(
            f"{PAIRED}/{t}",
            f"{TASKS[t].label} − BF16 (paired)",
            "{:+.2f}" if TASKS[t].percent else "{:+.4f}",
            TASKS[t].higher_is_better,
            stderr=f"{PAIRED}_se/{t}",
        )
        for t in tasks
    )


TABLE1_TASKS = (
    "hellaswag",
    "piqa",
    "arc_easy",
    "arc_challenge",
    "winogrande",
    "mmlu",
    "gsm8k",
    "fda",
    "swde",
    "squad_completion",
)
TABLE2_TASKS = ("gpqa_diamond", "mmlu", "gsm8k", "math500", "aime25", "humaneval", "livecodebench")
TINY_TASKS = TABLE1_TASKS[:7]  # the Table 1 columns with local documents
TINY = (
    Column("ppl/wikitext2", "WikiText-2 ppl", "{:.3f}", False),
    Column("ppl/c4", "C4 ppl", "{:.3f}", False),
    Column("nmse/attn_mean", "attn-output NMSE", "{:.3e}", False),
    *_task_columns(TINY_TASKS, stderr=True),
)
TINY_V2 = (
    *TINY[:3],
    *(
        Column(f"retrieval/{h}/{n}", f"{h} {n // 1024}K retrieval %", "{:.1f}")
        for h in ("noise", "c4")
        for n in (1024, 2048)
    ),
)
# the Table 1 twin on SmolLM2-MLA: the tasks whose prompts run past the 132 protected tokens
SMOL_FEWSHOT = (
    "hellaswag_10shot", "piqa_5shot", "arc_easy_25shot", "arc_challenge_25shot", "winogrande_5shot",
)  # fmt: skip
SMOL = (
    *TINY[:3],
    *(replace(c, header=f"{c.header} 0-shot") for c in _task_columns(TINY_TASKS[:5], stderr=True)),
    *_task_columns(SMOL_FEWSHOT, stderr=True),
    *(
        replace(c, header=f"{c.header} 5-shot")
        for c in _task_columns(("mmlu", "gsm8k", "gsm8k_reference"), stderr=True)
    ),
    *_paired_columns(("gsm8k_reference",)),
)
RULER_TASKS = ("s_niah_1", "s_niah_2", "s_niah_3")
# Fig. 4 twin: RULER S-NIAH accuracy per context length and its average (the paper's averages,
# DeepSeek-V2-Lite QuantMLA C4R4, beside a testbed's QuantMLA C4R4 row)
RULER = tuple(
    Column(f"ruler/{t}/{n}", f"S-NIAH-{t[-1]} {n // 1024}K", "{:.1f}")
    for t in RULER_TASKS
    for n in (1024, 2048, 4096, 8192)
) + tuple(Column(f"ruler/{t}/avg", f"S-NIAH-{t[-1]} avg", "{:.1f}", True, t) for t in RULER_TASKS)
LAYOUTS = {
    "table1": Layout(
        "table1", _task_columns(TABLE1_TASKS), tuple(f"acc/{t}" for t in TABLE1_TASKS), "table1"
    ),
    "table2": Layout(
        "table2", _task_columns(TABLE2_TASKS), tuple(f"acc/{t}" for t in TABLE2_TASKS), "table2"
    ),
    "tiny_table1": Layout("tiny_table1", TINY, tuple(f"acc/{t}" for t in TINY_TASKS)),
    "tiny_table1_v2": Layout("tiny_table1_v2", TINY_V2),
    "smol_table1": Layout(
        "smol_table1",
        SMOL,
        tuple(f"acc/{t}" for t in SMOL_FEWSHOT),
        changed=SMOL_FEWSHOT,
        paired=("gsm8k_reference",),
    ),
    # the baselines with one path quantized (c2r16, c4r16: content only; c16r4: RoPE only) beside
    # both (the Table 1 twin's C2R4 and C4R4 rows)
    "smol_path_split": Layout(
        "smol_path_split",
        (
            *TINY[:3],
            *_task_columns(("gsm8k_reference",), stderr=True),
            *_paired_columns(("gsm8k_reference",)),
        ),
        also=("smol_table1",),
        precisions=("bf16", "c2r4", "c2r16", "c16r4", "c4r4", "c4r16"),
        paired=("gsm8k_reference",),
    ),  # fmt: skip
    # the same cells' perplexity and NMSE on GSM8K's question-and-answer text (its first 4 windows)
    "smol_path_split_gsm8k": Layout(
        "smol_path_split_gsm8k",
        (
            Column("ppl/gsm8k", "GSM8K text ppl", "{:.3f}", False),
            Column("nmse/attn_mean", "attn-output NMSE", "{:.3e}", False),
        ),
        precisions=("bf16", "c2r4", "c2r16", "c16r4"),
    ),
    "smol_fig4_ruler": Layout(
        "smol_fig4_ruler",
        RULER,
        paper_table="fig4_ruler",
        also=("smol_fig4_ruler_moved",),  # QuantMLA's RoPE fitted on moved positions (a row)
        paper_model="deepseek_v2_lite",
    ),
    # full sets at 2,048 and 4,096 tokens (WikiText-2 test: 148 / 74 windows; the C4 slice: 73 / 36)
    "smol_table1_full": Layout(
        "smol_table1_full",
        tuple(
            Column(f"{metric}@{n}", f"{header} ({n // 1024}K)", fmt, False)
            for n in (2048, 4096)
            for metric, header, fmt in (
                ("ppl/wikitext2", "WikiText-2 ppl", "{:.3f}"),
                ("ppl/c4", "C4 ppl", "{:.3f}"),
                ("nmse/attn_mean", "attn-output NMSE", "{:.3e}"),
            )
        ),
        per_length=True,
    ),
}


def _average(metrics: dict, names) -> float | None:
    values = [metrics.get(name) for name in names]
    return None if any(v is None for v in values) else sum(values) / len(values)


CHANGED = "docs_changed"


def _changed_share(metrics: dict, bf16: dict | None, layout: Layout) -> float | None:
    """% of the `layout.changed` tasks' documents a quantized cell scores unlike the BF16 cell."""
    if bf16 is None or metrics is bf16:
        return None
    docs = [[m.get(f"docs/{t}") for t in layout.changed] for m in (metrics, bf16)]
    changed = changed_documents(*docs)
    return None if changed is None else 100 * float(changed.mean())


def _paired_change(metrics: dict, bf16: dict | None, task: str) -> tuple[float, float] | None:
    """A quantized cell's mean per-document change of `task`'s metric from BF16's, and its standard
    error over the documents (in the metric's recorded unit); None without both cells' scores."""
    if bf16 is None or metrics is bf16:
        return None
    ours, ref = (m.get(f"docs/{task}") for m in (metrics, bf16))
    if ours is None or ref is None or len(ours) != len(ref) or len(ours) < 2:
        return None
    scale = 100 if TASKS[task].percent else 1
    mean, se = paired_change(ours, ref)
    return scale * mean, scale * se


def _method_label(variant: str) -> str:
    name, _, settings = variant.partition(", ")
    return METHOD_LABEL[name] + (f" ({settings})" if settings else "")


def build(records: list[dict], layout: Layout, paper: dict | None = None) -> list[list[str]]:
    """The table as rows of cell strings; bold marked with **…**. First row is the header."""
    cells = {}
    for r in records:  # one cell may gather several jobs (perplexity + lm-eval suites)
        c = r["config"]
        if layout.precisions is not None and c["precision"]["name"] not in layout.precisions:
            continue
        key = (c["model"]["name"], c["precision"]["name"], method_variant(c["method"]))
        metrics = r["metrics"]
        if layout.per_length:
            metrics = {f"{k}@{c['model']['eval_seqlen']}": v for k, v in metrics.items()}
        cells.setdefault(key, {}).update(metrics)
    columns = list(layout.columns)
    if layout.average:
        for metrics in cells.values():
            metrics["avg"] = _average(metrics, layout.average)
        columns.append(Column("avg", "Avg", "{:.2f}", True, "avg"))
    for task in layout.paired:
        for (model, _, _), metrics in cells.items():
            change = _paired_change(metrics, cells.get((model, "bf16", "rtn")), task)
            if change is not None:
                metrics[f"{PAIRED}/{task}"], metrics[f"{PAIRED}_se/{task}"] = change
    if layout.changed:  # the paired view: how many documents the cache scores unlike BF16
        for (model, _, _), metrics in cells.items():
            metrics[CHANGED] = _changed_share(metrics, cells.get((model, "bf16", "rtn")), layout)
        columns.append(Column(CHANGED, "docs ≠ BF16 %", "{:.1f}", False))
    paper_rows = (paper or {}).get(layout.paper_table or "", {})
    header = ["model", "precision", "method"] + [c.header for c in columns]
    rows = [header]
    models = sorted({m for m, _, _ in cells})
    for model in models:
        precisions = sorted(
            {p for m, p, _ in cells if m == model},
            key=lambda p: (
                p not in PRECISION_ORDER,
                PRECISION_ORDER.index(p) if p in PRECISION_ORDER else 0,
                p,
            ),
        )
        for precision in precisions:
            variants = sorted(
                {v for m, p, v in cells if (m, p) == (model, precision) and v not in METHODS},
                key=lambda v: (METHOD_ORDER.index(v.split(", ")[0]), v),
            )  # each after the paper's rows
            # the paper's precisions list every method (a missing cell shows as "—"); another
            # precision only the methods that have a record
            listed = [
                m for m in METHOD_ORDER
                if precision in PAPER_PRECISIONS or (model, precision, m) in cells
            ]  # fmt: skip
            methods = ["rtn"] if precision == "bf16" else [*listed, *variants]
            shown, suffix = {}, {}
            for method in methods:
                for col in columns:
                    key = (method, col.metric)
                    shown[key], suffix[key] = col.show(cells.get((model, precision, method), {}))
            best = {}
            if precision != "bf16":
                for col in columns:
                    values = [
                        shown[(m, col.metric)]
                        for m in methods
                        if shown[(m, col.metric)] is not None
                    ]
                    if len(values) > 1:  # bold: the best of several
                        pick = max if col.higher_is_better else min
                        best[col.metric] = pick(values, key=float)
            for method in methods:
                row = [
                    model,
                    precision.upper(),
                    "—" if precision == "bf16" else _method_label(method),
                ]
                for col in columns:
                    text = shown[(method, col.metric)] or "—"
                    if text != "—" and best.get(col.metric) == text:
                        text = f"**{text}**"
                    text += suffix[(method, col.metric)]
                    stated = (
                        paper_rows.get(layout.paper_model or model, {})
                        .get(precision, {})
                        .get(method, {})
                        or {}
                    ).get(col.paper_key or "")
                    if stated is not None:
                        text += f" (paper {stated})"
                    row.append(text)
                rows.append(row)
    return rows


def to_markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def to_latex(rows: list[list[str]]) -> str:
    def cell(text: str) -> str:
        text = text.replace("—", "--").replace("†", r"$^\dagger$").replace("_", r"\_")
        if text.startswith("**"):
            inner, _, rest = text[2:].partition("**")
            text = rf"\textbf{{{inner}}}{rest}"
        return text

    spec = "lll" + "r" * (len(rows[0]) - 3)
    body = [" & ".join(cell(c) for c in r) + r" \\" for r in rows[1:]]
    head = " & ".join(cell(c) for c in rows[0]) + r" \\ \midrule"
    return "\n".join(
        [
            rf"\begin{{tabular}}{{{spec}}}",
            r"\toprule",
            head,
            *body,
            r"\bottomrule",
            r"\end{tabular}",
        ]
    )


def study_tables(paper: dict) -> dict:
    """The analyses' tables: name -> (rows from records, default experiment)."""
    return {
        "table4": (sensitivity.table4_rows, "fig2_sensitivity"),
        "table5": (probes.table5_rows, "table5_probes"),
        "table6": (
            lambda records: probes.table6_rows(records, paper.get("table6_interventions")),
            "table5_probes",
        ),
        "allocation": (probes.allocation_rows, "table5_probes"),
        "probe_layers": (probes.layer_rows, "table5_probes"),
        "frontier": (frontier.frontier_rows, "frontier"),
        "frontier_pairs": (frontier.comparison_rows, "frontier"),
        "smol_testbed": (testbed.testbed_rows, "smol_testbed"),
        "smol_outliers": (testbed.outlier_rows, "smol_testbed"),
        "smol_rtn_cost": (testbed.rtn_cost_rows, "smol_rtn_cost"),
        "layer_nmse": (layer_nmse.layer_rows, "table1"),
        "path_interaction": (path_split.interaction_rows, ""),  # the path split's experiments
        "rope_objective": (rope_objective.rope_objective_rows, ""),  # five experiments' records
        "rope_positions": (rope_positions.rope_position_rows, "smol_rope_positions"),
        "ruler_answer": (ruler_answer.answer_rows, "smol_ruler_answer"),
        "ruler_answer_paths": (ruler_answer.path_rows, "smol_ruler_answer"),
        "claims": (claims.claims_rows, ""),  # every experiment's records
        "smol_costs": (costs.cost_rows, ""),
        "fig5c_sweep": (
            lambda records: throughput.sweep_rows(records, paper["fig5c_throughput"]["c4r4"]),
            "fig5c_throughput",
        ),
    }


STUDY_TABLES = (
    "table4", "table5", "table6", "allocation", "probe_layers", "frontier", "frontier_pairs", "fig5c_sweep",
    "smol_testbed", "smol_outliers", "smol_rtn_cost", "claims", "smol_costs", "layer_nmse",
    "rope_objective", "rope_positions", "ruler_answer", "ruler_answer_paths", "path_interaction",
)  # fmt: skip


# a block's body may be empty (a page that names a table before it was generated)
GENERATED = re.compile(r"(<!-- generated: (\S+) -->\n)(.*?)(\n?<!-- end generated -->)", re.DOTALL)


def embed_in_docs(name: str, markdown: str, docs: Path) -> list[Path]:
    """Replace every `<!-- generated: name -->` block of the docs pages with the new table, so a
    table in a page is always the generated file, never a hand copy. Returns the pages changed."""
    changed = []
    for page in sorted(docs.glob("*.md")):
        text = page.read_text()
        new = GENERATED.sub(
            lambda m: (
                m[1] + markdown.strip() + "\n<!-- end generated -->" if m[2] == name else m[0]
            ),
            text,
        )
        if new != text:
            page.write_text(new)
            changed.append(page)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("table", choices=sorted(LAYOUTS) + list(STUDY_TABLES))
    parser.add_argument("--experiment", default=None, help="records of this experiment")
    parser.add_argument(
        "--results", default=None, help="results store (default: paths.results_dir)"
    )
    parser.add_argument("--source", choices=("store", "wandb"), default="store")
    parser.add_argument("--out", default="docs/tables")
    add_wandb_arguments(parser)
    args = parser.parse_args()
    paper = yaml.safe_load(PAPER_NUMBERS.read_text())
    if args.table in STUDY_TABLES:
        rows_of, default = study_tables(paper)[args.table]
    else:
        layout = LAYOUTS[args.table]
        default = layout.experiment

        def rows_of(records):
            return build(records, layout, paper)

    experiment = args.experiment or default
    root = Path(args.results) if args.results else default_results_dir()
    also = () if args.table in STUDY_TABLES else LAYOUTS[args.table].also
    records = []
    for name in (experiment, *also):
        if args.source == "wandb":
            from quantmla.tracking.wandb_mirror import load_records_from_wandb

            records += load_records_from_wandb(args.project, name, args.entity)
        else:
            records += load_records(root, name)
    if not records:
        where = f"W&B group {experiment!r}" if args.source == "wandb" else root / experiment
        sys.exit(
            f"error: no records for {args.table} in {where}; run `python -m quantmla.run "
            f"experiment={experiment}` first (nothing was written)"
        )
    rows = rows_of(records)
    markdown = to_markdown(rows)
    print(markdown)
    name = output_name(args.table, experiment, default)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown + "\n")
    (out / f"{name}.tex").write_text(to_latex(rows) + "\n")
    for page in embed_in_docs(name, markdown, out.parent):
        print(f"updated {page}")
    if args.wandb:
        from quantmla.tracking.wandb_mirror import log_artifacts

        records_dir = root / experiment if args.source == "store" else None
        log_artifacts(experiment, wandb_logger(args), table=(name, rows), records_dir=records_dir)


if __name__ == "__main__":
    main()
