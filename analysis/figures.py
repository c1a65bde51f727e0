"""Regenerate a figure (PNG and PDF).

    python -m analysis.figures fig5a [--out docs]

`fig5a`: persistent KV-cache memory per layer and request, 1K–1M tokens, for BF16, C4R4, C2R4 and
C4R16, from the byte layout in `quantmla.memory`, with the paper's stated ratios beside ours.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from quantmla.memory import LAYOUTS, compression

PAPER = Path(__file__).with_name("paper_numbers.yaml")


def fig5a(out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paper = yaml.safe_load(PAPER.read_text())["fig5a_memory"]["c4r4"]
    tokens = [2**k for k in range(10, 21)]
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, style in (("bf16", "k-"), ("c4r16", "C2--"), ("c4r4", "C0-o"), ("c2r4", "C3-s")):
        mib = [LAYOUTS[name].persistent_bytes(t) / 2**20 for t in tokens]
        ax.plot(tokens, mib, style, label=name.upper(), markersize=4)
        if name != "bf16":
            ax_ratio.plot(
                tokens,
                [compression(name, t) for t in tokens],
                style,
                label=name.upper(),
                markersize=4,
            )
    for a in (ax, ax_ratio):
        a.set_xscale("log", base=2)
        a.set_xlabel("cached tokens per request")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("persistent cache per layer (MiB)")
    ax.legend()
    ax_ratio.set_ylabel("compression vs BF16 (×)")
    for t, key in ((4096, "compression_4k"), (131_072, "compression_128k")):
        ours = compression("c4r4", t)
        ax_ratio.annotate(
            f"{ours:.2f}× (paper {paper[key]:.2f}×)",
            (t, ours),
            textcoords="offset points",
            xytext=(-30, -18),
            fontsize=8,
            color="C0",
        )
    ax_ratio.legend()
    fig.suptitle(
        "Fig. 5a — persistent MLA cache memory (d_c 512, d_r 64, 64-token pages, sink 4 + recent 128)"
    )
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "fig5a_memory.png", out / "fig5a_memory.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


FIGURES = {"fig5a": fig5a}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("figure", choices=sorted(FIGURES))
    parser.add_argument("--out", default="docs")
    args = parser.parse_args()
    for path in FIGURES[args.figure](Path(args.out)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
