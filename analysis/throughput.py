"""Fig. 5c as a KV-budget sweep (issue #31): BF16 mode vs the packed cache under vLLM's scheduler,
one row per (admission policy, chunk size, budget), from throughput records — the throughput ratio, the
preemptions and the recomputed tokens against how many of the requests BF16 can hold.

    python -m analysis.tables fig5c_sweep --experiment tiny_fig5c_paper_regime
    python -m analysis.figures fig5c_sweep --experiment tiny_fig5c_paper_regime
"""

from __future__ import annotations

from pathlib import Path

from analysis.common import pyplot, save

POLICIES = {False: "whole prompt", True: "first chunk"}  # eval.first_chunk_admission → label


def _pairs(records: list[dict]) -> list[tuple[bool, int, int, dict, dict]]:
    """(first-chunk admission, chunk tokens, budget, BF16 metrics, packed metrics), sorted; a
    cell with only one of the two is left out. The chunk is vLLM's own `max_num_batched_tokens`
    as the record holds it."""
    cells: dict[tuple, dict] = {}
    for r in records:
        e, m = r["config"]["eval"], r["metrics"]
        key = (
            bool(e.get("first_chunk_admission", False)),
            int(m.get("throughput/max_num_batched_tokens", 0)),
            int(e["kv_cache_memory_bytes"]),
        )
        precision = r["config"]["precision"]["name"]
        cells.setdefault(key, {})["bf16" if precision == "bf16" else "packed"] = m
    return [(*k, v["bf16"], v["packed"]) for k, v in sorted(cells.items()) if len(v) == 2]


def _held(m: dict) -> float:
    """Requests' worth of tokens (prompt + output) the engine's KV cache holds."""
    return m["throughput/kv_capacity_tokens"] / (
        m["throughput/input_tokens"] + m["throughput/output_tokens"]
    )


def sweep_rows(records: list[dict], paper: dict | None = None) -> list[list[str]]:
    rows = [[
        "admission", "chunk (tokens)", "KV budget (MB)", "BF16 holds (requests)", "BF16 preempt", "BF16 recomputed",
        "BF16 tok/s", "packed holds", "packed preempt", "packed tok/s", "packed / BF16",
    ]]  # fmt: skip
    for first_chunk, chunk, budget, bf16, packed in _pairs(records):
        rows.append([
            POLICIES[first_chunk], f"{chunk:,}", f"{budget / 1e6:g}", f"{_held(bf16):.2f}",
            f"{bf16['throughput/preemptions']:.0f}",
            f"{bf16.get('throughput/recomputed_tokens', float('nan')):,.0f}",
            f"{bf16['throughput/output_tok_s']:.2f}", f"{_held(packed):.2f}",
            f"{packed['throughput/preemptions']:.0f}", f"{packed['throughput/output_tok_s']:.2f}",
            f"{packed['throughput/output_tok_s'] / bf16['throughput/output_tok_s']:.2f}x",
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
    pairs = _pairs(records)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    chunks = sorted({p[1] for p in pairs})
    for first_chunk, style in ((False, "o--"), (True, "s-")):
        for shade, chunk in enumerate(chunks):
            chosen = [p for p in pairs if p[:2] == (first_chunk, chunk)]
            if not chosen:
                continue
            x = [_held(p[3]) for p in chosen]
            label = f"{POLICIES[first_chunk]} admission, chunks of {chunk:,}"
            ratio = [p[4]["throughput/output_tok_s"] / p[3]["throughput/output_tok_s"]
                     for p in chosen]  # fmt: skip
            axes[0].plot(x, ratio, style, color=f"C{shade}", label=label)
            for index, name in ((3, "BF16"), (4, "C4R4")):
                color = f"C{shade}" if name == "C4R4" else ("0.35", "0.65")[shade % 2]
                axes[1].plot(x, [p[index]["throughput/preemptions"] for p in chosen], style,
                             color=color, label=f"{name}, {label}")  # fmt: skip
                axes[2].plot(x, [p[index].get("throughput/recomputed_tokens", 0)
                                 for p in chosen], style, color=color)  # fmt: skip
    axes[0].axhline(1.0, color="0.6", lw=0.8)
    axes[0].axhline(paper["speedup"], color="C3", ls=":", lw=1)
    axes[0].annotate(f"paper {paper['speedup']}x", (0.02, paper["speedup"]), color="C3",
                     xycoords=("axes fraction", "data"), fontsize=7, va="bottom")  # fmt: skip
    axes[1].axhline(paper["bf16_preemptions"], color="C3", ls=":", lw=1)
    axes[1].annotate(f"paper BF16 {paper['bf16_preemptions']}", (0.02, paper["bf16_preemptions"]),
                     color="C3", xycoords=("axes fraction", "data"), fontsize=7, va="bottom")  # fmt: skip
    titles = ("output tok/s, C4R4 / BF16", "preemptions", "recomputed tokens")
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
