"""The byte–accuracy frontier (issue #23) from perplexity records: every cache (uniform formats and
mixed allocations, per method) at its bytes per token against Δ perplexity and attention-output
NMSE; paired per-window spreads; the allocator's predicted output error against the measured NMSE.

    python -m analysis.tables frontier --experiment tiny_frontier
    python -m analysis.figures frontier --experiment tiny_frontier
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.common import paired_change, pyplot, save
from analysis.probes import spearman
from quantmla.config import ALLOCATION_ERRORS
from quantmla.memory import ENGINE_PRECISIONS, LAYOUTS
from quantmla.spec import UNQUANTIZED_BITS, QuantizerSpec

ENGINE_NAMES = {p: name for name, p in ENGINE_PRECISIONS.items()}  # cnvfp4re4m3t → nvfp4_ds_mla
# Caches that keep the RoPE key in BF16 as an engine does (TurboQuant's, fp8_ds_mla's values)
BF16_KEY_CACHES = {ENGINE_PRECISIONS["turboquant4"], LAYOUTS["fp8_ds_mla"].spec.precision}

# precision.allocation_error → its label (the others are their own)
ERROR_MODELS = {m: {"response": "R × NMSE"}.get(m, m) for m in ALLOCATION_ERRORS}


@dataclass(frozen=True)
class Point:
    method: str
    cache: str  # a format, or "mixed@<budget>"
    layers: tuple[str, ...]  # each layer's format
    bytes: float  # packed bytes per token and layer (memory model)
    bytes_protected: float  # with one request's BF16 protection amortised at `protected_at`
    ppl: dict  # dataset -> perplexity
    nll: dict  # dataset -> per-window mean NLL
    nmse: float | None
    record: dict
    error_model: str = ""  # a mixed allocation's precision.allocation_error

    @property
    def mixed(self) -> bool:
        return self.cache.startswith("mixed")

    @property
    def per_path(self) -> bool:
        """One path quantized, the other at 16 bits, in no engine's layout: a diagnostic that
        splits a format's error by path (nvfp4_ds_mla's as cnvfp4r16 and c16re4m3t)."""
        if self.mixed or self.cache == "bf16" or self.cache in BF16_KEY_CACHES:
            return False
        spec = QuantizerSpec.from_precision(self.cache)
        return UNQUANTIZED_BITS in (spec.content_bits, spec.rope_bits)


def _narrower(own: list[str], union: set[str]) -> str:
    """A mixed record's label suffix when it chose among fewer candidates than the others."""
    left_out = sorted(union - set(own))
    if not left_out:
        return ""
    return f", without {' '.join(left_out)}" if len(left_out) <= 3 else f", {len(own)} candidates"


def points(records: list[dict]) -> list[Point]:
    out = []
    union = {
        c for r in records if r["config"]["precision"].get("name") == "mixed"
        for c in r["metrics"].get("allocation/candidates", ())
    }  # fmt: skip
    for r in records:
        cfg, m = r["config"], r["metrics"]
        if cfg["eval"]["kind"] != "perplexity" or "cache/bytes_per_token" not in m:
            continue
        p = cfg["precision"]
        datasets = cfg["eval"]["datasets"]
        mixed = p["name"] == "mixed"
        layers = tuple(m["allocation/precisions"]) if mixed else ()
        model = p.get("allocation_error", "response")  # records before the field: response
        joint = f", joint {p['joint_top']}" if p.get("joint_top", 1) > 1 else ""
        if mixed:
            joint += _narrower(m["allocation/candidates"], union)
        out.append(
            Point(
                cfg["method"]["name"],
                f"mixed@{p['budget_bytes']:g} ({ERROR_MODELS[model]}{joint})"
                if mixed
                else p["name"],
                layers,
                m["cache/bytes_per_token"],
                m["cache/bytes_per_token_protected"],
                {d: m[f"ppl/{d}"] for d in datasets},
                {d: m.get(f"nll_windows/{d}") for d in datasets},
                m.get("nmse/attn_mean"),
                r,
                model if mixed else "",
            )
        )
    return sorted(out, key=lambda x: (x.method != "rtn", x.method, x.bytes, x.mixed, x.cache))


def reference(pts: list[Point]) -> Point:
    found = [p for p in pts if p.cache == "bf16"]
    if not found:
        raise SystemExit("error: the frontier needs its BF16 record (precision=bf16 in the sweep)")
    return found[0]


def delta_percent(p: Point, ref: Point, dataset: str) -> float:
    return 100.0 * (p.ppl[dataset] / ref.ppl[dataset] - 1.0)


def paired(a: Point, b: Point, dataset: str) -> tuple[float, float]:
    """Δ log perplexity a − b (%, ≈ relative) and its standard error from the per-window differences
    (both records scored the same windows)."""
    mean, se = paired_change(a.nll[dataset], b.nll[dataset])
    return 100.0 * mean, 100.0 * se


def predictor(pts: list[Point], method: str, model: str) -> tuple[list[str], np.ndarray] | None:
    """(candidates, (L, K) predicted output errors) of the method's first mixed record with error
    model `model`: its errors are measured after that method's transforms at each candidate."""
    for p in pts:
        if p.mixed and p.method == method and p.error_model == model:
            m = p.record["metrics"]
            return m["allocation/candidates"], np.asarray(m["allocation/predicted_errors"])
    return None


def predicted(p: Point, table) -> float | None:
    """Σ_ℓ predicted output NMSE of p's per-layer formats, when they are all candidates."""
    candidates, errors = table
    layers = p.layers or (p.cache,) * errors.shape[0]
    if any(f not in candidates for f in layers):
        return None
    return float(sum(errors[i, candidates.index(f)] for i, f in enumerate(layers)))


def rank_agreement(pts: list[Point], method: str, model: str) -> tuple[float, int] | None:
    """Spearman of predicted vs measured NMSE over the method's caches its predictor covers."""
    table = predictor(pts, method, model)
    if table is None:
        return None
    pairs = [
        (predicted(p, table), p.nmse)
        for p in pts
        if p.method == method and p.cache != "bf16" and p.nmse is not None
    ]
    pairs = [(a, b) for a, b in pairs if a is not None]
    return (spearman(*zip(*pairs)), len(pairs)) if len(pairs) >= 3 else None


def _fmt_delta(p: Point, ref: Point, d: str) -> str:
    return f"{p.ppl[d]:.3f} ({delta_percent(p, ref, d):+.2f} %)"


def frontier_rows(records: list[dict]) -> list[list[str]]:
    pts = points(records)
    ref = reference(pts)
    datasets = list(ref.ppl)
    tables = {(p.method, m): predictor(pts, p.method, m) for p in pts for m in ERROR_MODELS}
    length = ref.record["metrics"]["cache/protected_at"]
    rows = [
        [
            "method",
            "cache",
            "B/token (packed)",
            f"B/token (+ protection at {length})",
            *[f"ppl {d} (Δ)" for d in datasets],
            "attn NMSE",
            *[f"predicted Σ NMSE ({label})" for label in ERROR_MODELS.values()],
            "layers",
        ]
    ]
    for p in pts:
        preds = [tables[p.method, m] and predicted(p, tables[p.method, m]) for m in ERROR_MODELS]
        rows.append(
            [
                "—" if p.cache == "bf16" else p.method,
                f"{p.cache} ({ENGINE_NAMES[p.cache]})" if p.cache in ENGINE_NAMES else p.cache,
                f"{p.bytes:g}",
                f"{p.bytes_protected:.1f}",
                *[_fmt_delta(p, ref, d) for d in datasets],
                "—" if p.nmse is None else f"{p.nmse:.2e}",
                *["—" if x is None or p.cache == "bf16" else f"{x:.2e}" for x in preds],
                " ".join(p.layers) if p.layers else "",
            ]
        )
    return rows


def comparison_rows(records: list[dict]) -> list[list[str]]:
    """Each mixed cache against the same method's uniform formats at its budget's bytes and the
    cheapest one above: paired Δ log-perplexity ± 2 standard errors per dataset (the windows'
    spread; RTN is deterministic, so this is the run-to-run uncertainty of the comparison); then
    those uniform caches against BF16 (the most any cache can gain on them); last, the
    allocator's rank agreement with the measured NMSE."""
    pts = points(records)
    ref = reference(pts)
    datasets = list(ref.ppl)
    rows = [["method", "cache", "vs", *[f"Δ log ppl {d} (± 2 SE)" for d in datasets]]]

    def row(p: Point, u: Point) -> list[str]:
        cells = []
        for d in datasets:
            if p.nll[d] is None or u.nll[d] is None:
                cells.append("—")
                continue
            delta, se = paired(p, u, d)
            cells.append(f"{delta:+.3f} ± {2 * se:.3f} %")
        return [p.method, f"{p.cache}, {p.bytes:g} B", f"{u.cache}, {u.bytes:g} B", *cells]

    compared = {}
    for p in (x for x in pts if x.mixed):
        budget = p.record["config"]["precision"]["budget_bytes"]
        uniform = [u for u in pts if u.method == p.method and not u.mixed and u.cache != "bf16"]
        above = sorted((u for u in uniform if u.bytes > budget), key=lambda u: u.bytes)[:1]
        for u in [u for u in uniform if u.bytes == budget] + above:
            rows.append(row(p, u))
            compared[u.method, u.cache] = u
    for u in compared.values():  # the headroom: how far each compared uniform cache is from BF16
        rows.append(row(u, ref))
    for method, model in dict.fromkeys((p.method, p.error_model) for p in pts if p.mixed):
        agreement = rank_agreement(pts, method, model)
        if agreement:
            rows.append(
                [
                    method,
                    f"predicted ({ERROR_MODELS[model]}) vs measured NMSE",
                    f"Spearman {agreement[0]:.3f}",
                    f"{agreement[1]} caches",
                ]
                + [""] * (len(datasets) - 1)
            )
    return rows


def frontier(records: list[dict], out: Path, stem: str) -> list[Path]:
    """Panels over bytes per token (protection included): Δ perplexity per dataset (symlog), and
    the attention-output NMSE; uniform formats labelled, mixed allocations as stars, per method.
    Per-path diagnostics are left to the table: they are no cache one would deploy."""
    plt = pyplot()
    pts = [p for p in points(records) if not p.per_path]
    ref = reference(pts)
    datasets = list(ref.ppl)
    fig, axes = plt.subplots(1, len(datasets) + 1, figsize=(4.2 * (len(datasets) + 1), 3.6))
    colors = {"rtn": "C0", "quantmla": "C3", "smoothquant": "C2", "quarot": "C1"}
    panels = [
        (d, lambda p, d=d: delta_percent(p, ref, d), f"Δ perplexity {d} (%)") for d in datasets
    ]
    panels.append(("nmse", lambda p: p.nmse, "attention-output NMSE"))
    at_bytes = {}  # bytes -> the uniform formats there
    for p in pts:
        if not p.mixed:
            at_bytes.setdefault(p.bytes_protected, set()).add(p.cache)
    for ax, (_, value, title) in zip(axes, panels):
        labelled = set()  # a format alone at its bytes is named once a panel
        for method in dict.fromkeys(p.method for p in pts):
            for mixed, marker in ((False, "o"), (True, "*")):
                sel = [
                    p for p in pts if p.method == method and p.mixed == mixed and p.cache != "bf16"
                ]
                sel = [p for p in sel if value(p) is not None]
                if not sel:
                    continue
                xs, ys = [p.bytes_protected for p in sel], [value(p) for p in sel]
                ax.plot(
                    xs, ys, marker=marker, ls="-" if mixed else "none", color=colors.get(method, "k"),
                    ms=10 if mixed else 5, label=f"{method} {'mixed' if mixed else 'uniform'}",
                )  # fmt: skip
                if not mixed:
                    for p, x, y in zip(sel, xs, ys):
                        if p.cache in labelled and len(at_bytes[x]) == 1:
                            continue
                        labelled.add(p.cache)
                        ax.annotate(
                            p.cache, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points"
                        )
        ax.set_xlabel(
            f"bytes / token / layer (+ protection at {ref.record['metrics']['cache/protected_at']})"
        )
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[:-1]:  # Δ spans 0.01 % to hundreds: logarithmic past 0.1 %
        ax.set_yscale("symlog", linthresh=0.1)
    axes[-1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"{ref.record['config']['model']['name']}: the byte–accuracy frontier", fontsize=10
    )
    fig.tight_layout()
    return save(fig, out, stem)
