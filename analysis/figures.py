"""Regenerate a figure (PNG and PDF) from the results store only.

    python -m analysis.figures {fig2,fig4,fig5a,fig5b,fig5c,fig6,fig7,frontier,layer_nmse} [--experiment NAME] [--results results] [--out docs]

`fig4`: RULER S-NIAH accuracy vs context length (`experiment=fig4_ruler`).
`fig5b`: decode latency relative to BF16 vs context (`experiment=fig5b_latency`, needs a GPU).
`fig5c`: cache-pressure serving through vLLM, BF16 vs packed (`experiment=fig5c_throughput`).

`fig2`, `fig6`: the sensitivity study (`experiment=fig2_sensitivity`, analysis/sensitivity.py);
`fig7`: the operator analysis (`experiment=table5_probes`, analysis/probes.py).
`frontier`: bytes per token vs Δ perplexity and NMSE (`experiment=frontier`, analysis/frontier.py).
`layer_nmse`: each method's attention-output NMSE per layer (a Table 1 twin's perplexity records).

`fig5a`: persistent KV-cache memory per layer and request, 1K–1M tokens, one curve per precision,
from the records of `python -m quantmla.run experiment=fig5a_memory` (the model's own d_c, d_r),
with the paper's stated ratios beside ours. Output files are byte-identical when nothing changed
(no timestamps in the PDF or PNG), so regenerating never dirties the tree for nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from analysis import frontier, layer_nmse, probes, sensitivity, throughput
from analysis.common import (
    add_wandb_arguments,
    default_results_dir,
    output_name,
    pyplot,
    save,
    wandb_logger,
)
from quantmla.tracking.store import load_records

PAPER = Path(__file__).with_name("paper_numbers.yaml")
STYLES = {"bf16": "k-", "c4r16": "C2--", "c4r4": "C0-o", "c2r4": "C3-s"}


def _series(metrics: dict, prefix: str) -> tuple[list[int], list[float]]:
    points = sorted((int(k.split("@")[1]), v) for k, v in metrics.items() if k.startswith(prefix))
    return [t for t, _ in points], [v for _, v in points]


def fig5a(records: list[dict], out: Path) -> list[Path]:
    plt = pyplot()

    paper = yaml.safe_load(PAPER.read_text())["fig5a_memory"]["c4r4"]
    models = sorted({r["config"]["model"]["name"] for r in records})
    model = models[0]
    by_precision = {
        r["config"]["precision"]["name"]: r["metrics"]
        for r in records
        if r["config"]["model"]["name"] == model
    }
    order = [p for p in STYLES if p in by_precision] + sorted(set(by_precision) - set(STYLES))
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in order:
        metrics, style = by_precision[name], STYLES.get(name, "-")
        tokens, size = _series(metrics, "memory/bytes@")
        ax.plot(tokens, [b / 2**20 for b in size], style, label=name.upper(), markersize=4)
        if name != "bf16":
            tokens, ratio = _series(metrics, "memory/compression@")
            ax_ratio.plot(tokens, ratio, style, label=name.upper(), markersize=4)
            if name == "c4r4":
                for t, key in ((4096, "compression_4k"), (131_072, "compression_128k")):
                    if t in tokens:
                        ours = ratio[tokens.index(t)]
                        ax_ratio.annotate(
                            f"{ours:.2f}× (paper {paper[key]:.2f}×)",
                            (t, ours),
                            textcoords="offset points",
                            xytext=(-30, -18),
                            fontsize=8,
                            color="C0",
                        )
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("cached tokens per request")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("persistent cache per layer (MiB)")
    ax.legend()
    ax_ratio.set_ylabel("compression vs BF16 (×)")
    ax_ratio.legend()
    any_metrics = by_precision[order[0]]
    fig.suptitle(
        f"Fig. 5a — persistent MLA cache memory, {model} (d_c {any_metrics['memory/d_c']}, "
        f"d_r {any_metrics['memory/d_r']}, 64-token pages, protection sink + recent)"
    )
    stem = "fig5a_memory" if model == "deepseek_v2_lite" else f"fig5a_memory_{model}"
    return save(fig, out, stem)


def fig4(records: list[dict], out: Path, stem: str) -> list[Path]:
    """RULER S-NIAH-1/2/3: accuracy vs context length, one line per precision × method, each
    labelled with its average (and the paper's, where it states one)."""
    plt = pyplot()

    from quantmla.methods.registry import METHODS

    paper = yaml.safe_load(PAPER.read_text())["fig4_ruler"]
    tasks = ("s_niah_1", "s_niah_2", "s_niah_3")
    model = sorted({r["config"]["model"]["name"] for r in records})[0]
    rows = sorted(
        (r for r in records if r["config"]["model"]["name"] == model),
        key=lambda r: (
            r["config"]["precision"]["name"] != "bf16",
            list(METHODS).index(r["config"]["method"]["name"]),
        ),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, task in zip(axes, tasks):
        for i, r in enumerate(rows):
            precision, method = r["config"]["precision"]["name"], r["config"]["method"]["name"]
            m = r["metrics"]
            lengths = sorted(
                int(k.split("/")[2])
                for k in m
                if k.startswith(f"ruler/{task}/") and not k.endswith("avg")
            )
            if not lengths:
                continue
            bf16 = precision == "bf16"
            label = "BF16" if bf16 else f"{METHODS[method].label} {precision.upper()}"
            label += f" (avg {m[f'ruler/{task}/avg']:.1f}"
            stated = paper.get(model, {}).get(precision, {}).get(method, {}).get(task)
            label += f"; paper {stated})" if stated is not None else ")"
            ax.plot(
                lengths,
                [m[f"ruler/{task}/{n}"] for n in lengths],
                "k-" if bf16 else f"C{i}-o",
                label=label,
                markersize=4,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(task.replace("s_niah_", "S-NIAH-"))
        ax.set_xlabel("context length (tokens)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    samples = rows[0]["metrics"].get("ruler/samples_per_length") if rows else None
    fig.suptitle(f"RULER S-NIAH, {model}, {samples} samples per variant and length", fontsize=10)
    return save(fig, out, stem)


def fig5b(records: list[dict], out: Path, stem: str) -> list[Path]:
    """Decode latency relative to the BF16 kernel vs context, per model (h_q) and batch, with the
    paper's −7.42 %…+4.29 % band for C4R4."""
    plt = pyplot()

    band = yaml.safe_load(PAPER.read_text())["fig5b_latency"]["c4r4"]
    panels = [
        (r, batch)
        for r in sorted(records, key=lambda r: r["metrics"].get("latency/heads", 0))
        for batch in (8, 32)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (record, batch) in zip(axes[0], panels):
        m = record["metrics"]
        ax.axhspan(
            1 + band["vs_bf16_min_pct"] / 100,
            1 + band["vs_bf16_max_pct"] / 100,
            color="0.85",
            label="paper C4R4 band",
        )
        variants = sorted(
            {k.split("/")[1] for k in m if k.startswith("vs_bf16/") and k.split("/")[1] != "bf16"}
        )
        for variant in variants:
            keys = sorted(
                (int(k.split("/")[3]), v)
                for k, v in m.items()
                if k.startswith(f"vs_bf16/{variant}/b{batch}/")
            )
            if keys:
                style = {"c4r4": "C0-o", "c2r4": "C3-s"}.get(variant, "--")
                ax.plot(
                    [c for c, _ in keys], [v for _, v in keys], style, label=variant, markersize=4
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(
            f"{record['config']['model']['name']} (h_q {m.get('latency/heads')}), batch {batch}",
            fontsize=9,
        )
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("decode step latency / BF16 kernel")
    device = records[0]["metrics"].get("latency/device", "?")
    fig.suptitle(f"Decode attention latency, CUDA-graph median, {device}", fontsize=10)
    return save(fig, out, stem)


def fig5c(records: list[dict], out: Path, stem: str) -> list[Path]:
    """Cache-pressure serving under vLLM's scheduler, BF16 mode vs the packed cache: KV token
    capacity, running requests (max and mean), preemptions, engine steps and output tok/s, with
    the paper's numbers (its own workload and GPUs) beside ours."""
    paper = yaml.safe_load(PAPER.read_text())["fig5c_throughput"]["c4r4"]
    cells = {
        (r["config"]["eval"].get("kv_cache_memory_bytes"),
         r["config"]["eval"].get("first_chunk_admission", False))
        for r in records
    }  # fmt: skip
    if len(cells) > 1:  # a budget sweep: its own figure
        return throughput.fig5c_sweep(records, out, stem, paper)
    plt = pyplot()
    by_precision = {r["config"]["precision"]["name"]: r["metrics"] for r in records}
    order = [p for p in ("bf16", "c4r4", "c2r4") if p in by_precision]
    panels = [
        ("kv_capacity_tokens", "KV capacity (tokens)"),
        ("running_max", "running requests (max / mean)"),
        ("preemptions", "preemptions"),
        ("engine_steps", "engine steps"),
        ("output_tok_s", "output tokens/s"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 3.4))
    colors = {"bf16": "0.5", "c4r4": "C0", "c2r4": "C3"}
    for ax, (key, title) in zip(axes, panels):
        values = [by_precision[p][f"throughput/{key}"] for p in order]
        bars = ax.bar(order, values, color=[colors[p] for p in order])
        if key == "running_max":
            means = [by_precision[p]["throughput/running_mean"] for p in order]
            ax.scatter(order, means, color="k", marker="_", s=400, zorder=3, label="mean")
            ax.legend(fontsize=7)
        ax.bar_label(
            bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values], fontsize=7
        )
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    m = records[0]["metrics"]
    model = records[0]["config"]["model"]["name"]
    fig.suptitle(
        f"{model}: {m['throughput/requests']} requests x ({m['throughput/input_tokens']} in, "
        f"{m['throughput/output_tokens']} out), one KV budget, vLLM scheduler. Paper (its GPUs, "
        f"128K in): BF16 {paper['bf16_preemptions']} preemptions, {paper['bf16_tok_s']} -> "
        f"{paper['c4r4_tok_s']} tok/s ({paper['speedup']}x)",
        fontsize=8,
    )
    fig.tight_layout()
    return save(fig, out, stem)


def _named(draw, name):
    """A study figure whose file name carries the experiment when it is not the paper's."""

    def figure(records, out, experiment, default):
        return draw(records, out, output_name(name, experiment, default))

    return figure


def _fig5a(records, out, experiment, default):
    return fig5a(records, out)


def _figures():
    return {
        "fig2": (_named(sensitivity.fig2, "fig2_sensitivity"), "fig2_sensitivity"),
        "fig4": (_named(fig4, "fig4_ruler"), "fig4_ruler"),
        "fig5a": (_fig5a, "fig5a_memory"),
        "fig5b": (_named(fig5b, "fig5b_latency"), "fig5b_latency"),
        "fig5c": (_named(fig5c, "fig5c_throughput"), "fig5c_throughput"),
        "fig5c_sweep": (_named(_fig5c_sweep, "fig5c_sweep"), "fig5c_throughput"),
        "fig6": (_named(sensitivity.fig6, "fig6_sensitivity_layers"), "fig2_sensitivity"),
        "fig7": (_named(probes.fig7, "fig7_operator"), "table5_probes"),
        "frontier": (_named(frontier.frontier, "frontier"), "frontier"),
        "layer_nmse": (_named(layer_nmse.fig_layer_nmse, "layer_nmse"), "table1"),
    }


def _fig5c_sweep(records, out, stem):
    paper = yaml.safe_load(PAPER.read_text())["fig5c_throughput"]["c4r4"]
    return throughput.fig5c_sweep(records, out, stem, paper)


FIGURES = ("fig2", "fig4", "fig5a", "fig5b", "fig5c", "fig5c_sweep", "fig6", "fig7", "frontier", "layer_nmse")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("figure", choices=FIGURES)
    parser.add_argument("--experiment", default=None, help="records of this experiment")
    parser.add_argument(
        "--results", default=None, help="results store (default: paths.results_dir)"
    )
    parser.add_argument("--out", default="docs")
    add_wandb_arguments(parser)
    args = parser.parse_args()
    draw, default = _figures()[args.figure]
    experiment = args.experiment or default
    root = Path(args.results) if args.results else default_results_dir()
    records = load_records(root, experiment)
    if not records:
        sys.exit(
            f"error: no records in {root / experiment}; run `python -m quantmla.run "
            f"experiment={experiment}` first (nothing was written)"
        )
    written = draw(records, Path(args.out), experiment, default)
    for path in written:
        print(f"wrote {path}")
    if args.wandb:
        from quantmla.tracking.wandb_mirror import log_artifacts

        log_artifacts(
            experiment, wandb_logger(args), figures=written, records_dir=root / experiment
        )


if __name__ == "__main__":
    main()
