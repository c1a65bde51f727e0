"""Fig. 5c as a KV-budget sweep (issue #31): BF16 mode vs the packed cache under vLLM's scheduler,
one row per (admission policy, chunk size, budget), from throughput records — the throughput ratio, the
preemptions and the recomputed tokens against how many of the requests BF16 can hold.

    python -m analysis.tables fig5c_sweep --experiment tiny_fig5c_paper_regime
    python -m analysis.figures fig5c_sweep --experiment tiny_fig5c_paper_regime
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from analysis.common import pyplot, save

POLICIES = {False: "whole prompt", True: "first chunk"}  # eval.first_chunk_admission → label


@dataclass(frozen=True)
class Cell:
    """One (admission, chunk, budget) cell: per repeat (`eval.trial`) with both precisions, BF16's
    and the packed cache's metrics, in trial order."""

    first_chunk: bool
    chunk: int
    budget: int
    runs: list[tuple[dict, dict]]

    @property
    def bf16(self) -> dict:
        return self.runs[0][0]

    def ratios(self) -> list[float]:
        return [p["throughput/output_tok_s"] / b["throughput/output_tok_s"] for b, p in self.runs]

    def median(self, key: str, which: int) -> float:
        return statistics.median(run[which][key] for run in self.runs)


def cells(records: list[dict]) -> list[Cell]:
    """Cells sorted by (admission, chunk, budget); a repeat with only one of the two precisions
    is left out. The chunk is vLLM's own `max_num_batched_tokens` as the record holds it."""
    found: dict[tuple, dict] = {}
    for r in records:
        e, m = r["config"]["eval"], r["metrics"]
        key = (
            bool(e.get("first_chunk_admission", False)),
            int(m.get("throughput/max_num_batched_tokens", 0)),
            int(e["kv_cache_memory_bytes"]),
        )
        precision = "bf16" if r["config"]["precision"]["name"] == "bf16" else "packed"
        found.setdefault(key, {}).setdefault(int(e.get("trial", 0)), {})[precision] = m
    out = []
    for key, trials in sorted(found.items()):
        runs = [(t["bf16"], t["packed"]) for _, t in sorted(trials.items()) if len(t) == 2]
        if runs:
            out.append(Cell(*key, runs))
    return out


def spread(values: list[float], unit: str = "x") -> str:
    """'2.43x' for one run, else 'median [min–max] (n)'."""
    if len(values) == 1:
        return f"{values[0]:.2f}{unit}"
    low, high = min(values), max(values)
    return f"{statistics.median(values):.2f}{unit} [{low:.2f}–{high:.2f}] ({len(values)})"


def _held(m: dict) -> float:
    """Requests' worth of tokens (prompt + output) the engine's KV cache holds."""
    return m["throughput/kv_capacity_tokens"] / (
        m["throughput/input_tokens"] + m["throughput/output_tokens"]
    )


def sweep_rows(records: list[dict], paper: dict | None = None) -> list[list[str]]:
    """One row per cell; tok/s and preemptions are medians over repeats, the ratio is each
    repeat's packed / BF16, as median [min–max] (runs) when repeated."""
    rows = [[
        "admission", "chunk (tokens)", "KV budget (MB)", "BF16 holds (requests)", "BF16 preempt", "BF16 recomputed",
        "BF16 tok/s", "packed holds", "packed preempt", "packed tok/s", "packed / BF16",
    ]]  # fmt: skip
    for c in cells(records):
        packed = c.runs[0][1]
        rows.append([
            POLICIES[c.first_chunk], f"{c.chunk:,}", f"{c.budget / 1e6:g}", f"{_held(c.bf16):.2f}",
            f"{c.median('throughput/preemptions', 0):.0f}",
            f"{c.bf16.get('throughput/recomputed_tokens', float('nan')):,.0f}",
            f"{c.median('throughput/output_tok_s', 0):.2f}", f"{_held(packed):.2f}",
            f"{c.median('throughput/preemptions', 1):.0f}",
            f"{c.median('throughput/output_tok_s', 1):.2f}", spread(c.ratios()),
        ])  # fmt: skip
    if paper:
        rows.append([
            "paper (8 GPUs, 128K in)", "8,192", "", "", str(paper["bf16_preemptions"]), "",
            f"{paper['bf16_tok_s']}", "", "", f"{paper['c4r4_tok_s']}", f"{paper['speedup']}x",
        ])  # fmt: skip
    return rows


def fig5c_sweep(records: list[dict], out: Path, stem: str, paper: dict) -> list[Path]:
    """Throughput ratio, preemptions and recomputed tokens vs the requests BF16 holds, one line
    per (admission policy, chunk size); the paper's point (ratio, BF16 preemptions) marked."""
    plt = pyplot()
    found = cells(records)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    chunks = sorted({c.chunk for c in found})
    for first_chunk, style in ((False, "o--"), (True, "s-")):
        for shade, chunk in enumerate(chunks):
            chosen = [c for c in found if (c.first_chunk, c.chunk) == (first_chunk, chunk)]
            if not chosen:
                continue
            x = [_held(c.bf16) for c in chosen]
            label = f"{POLICIES[first_chunk]} admission, chunks of {chunk:,}"
            mid = [statistics.median(c.ratios()) for c in chosen]
            span = [[m - min(c.ratios()) for m, c in zip(mid, chosen)],
                    [max(c.ratios()) - m for m, c in zip(mid, chosen)]]  # fmt: skip
            axes[0].errorbar(x, mid, yerr=span, fmt=style, color=f"C{shade}", label=label,
                             capsize=2)  # fmt: skip
            for index, name in ((0, "BF16"), (1, "C4R4")):
                color = f"C{shade}" if name == "C4R4" else ("0.35", "0.65")[shade % 2]
                axes[1].plot(x, [c.median("throughput/preemptions", index) for c in chosen],
                             style, color=color, label=f"{name}, {label}")  # fmt: skip
                axes[2].plot(x, [c.median("throughput/recomputed_tokens", index)
                                 if "throughput/recomputed_tokens" in c.runs[0][index] else 0
                                 for c in chosen], style, color=color)  # fmt: skip
    axes[0].axhline(1.0, color="0.6", lw=0.8)
    axes[0].axhline(paper["speedup"], color="C3", ls=":", lw=1)
    axes[0].annotate(f"paper {paper['speedup']}x", (0.02, paper["speedup"]), color="C3",
                     xycoords=("axes fraction", "data"), fontsize=7, va="bottom")  # fmt: skip
    axes[1].axhline(paper["bf16_preemptions"], color="C3", ls=":", lw=1)
    axes[1].annotate(f"paper BF16 {paper['bf16_preemptions']}", (0.02, paper["bf16_preemptions"]),
                     color="C3", xycoords=("axes fraction", "data"), fontsize=7, va="bottom")  # fmt: skip
    titles = ("output tok/s, C4R4 / BF16 (median, min–max)", "preemptions (median)",
              "recomputed tokens (median)")  # fmt: skip
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("requests BF16 holds at the budget")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6)
    axes[0].legend(fontsize=7)
    m = records[0]["metrics"]
    fig.suptitle(
        f"{records[0]['config']['model']['name']}: {m['throughput/requests']} x "
        f"({m['throughput/input_tokens']} in, {m['throughput/output_tokens']} out), vLLM's "
        "scheduler (chunked prefill), KV budget swept",
        fontsize=8,
    )
    return save(fig, out, stem)
