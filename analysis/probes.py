"""Aggregates of the operator analysis (docs/method.md §8) from its per-cell records: Tables 5 and 6, Fig. 7.

Points are (model, cell, layer). Target y = log(G_P/G_C); predictors, each with its own intercept
fitted on the fit set and applied unchanged to the evaluation set:
  full:             log(T_P/T_C) + log(A_P/A_C) + γ
  trace-only:       log(T_P/T_C) + γ_T
  cache-error-only: γ_0
Fit/evaluation split: with two or more models, fit on the first (paper: DeepSeek-V2-Lite) and
evaluate on the others; with one model, fit on the first half of its layers × WikiText-2 cells and
evaluate on the second half × C4 cells (no point in both).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.common import MODEL_ORDER, cell, pyplot, save

PREDICTORS = ("full", "trace-only", "cache-error-only")


@dataclass
class Point:
    model: str
    cell: str
    layer: int
    y: float  # log(G_P / G_C)
    log_t: float  # log(T_P / T_C)
    log_a: float  # log(A_P / A_C)


def _records(records):
    rows = [
        r for r in records if "probes/G_content" in r["metrics"] and "probes/G_rope" in r["metrics"]
    ]
    key = lambda r: (  # noqa: E731
        r["config"]["model"]["name"] not in MODEL_ORDER,
        MODEL_ORDER.index(r["config"]["model"]["name"])
        if r["config"]["model"]["name"] in MODEL_ORDER
        else 0,
        r["config"]["model"]["name"],
        cell(r),
    )
    return sorted(rows, key=key)


def points(records: list[dict]) -> list[Point]:
    out = []
    for r in _records(records):
        m = r["metrics"]
        for i, layer in enumerate(m["probes/layers"]):
            out.append(
                Point(
                    r["config"]["model"]["name"],
                    cell(r),
                    layer,
                    float(np.log(m["probes/G_rope"][i] / m["probes/G_content"][i])),
                    float(np.log(m["probes/T_rope"][i] / m["probes/T_content"][i])),
                    float(np.log(m["probes/A_rope"][i] / m["probes/A_content"][i])),
                )
            )
    return out


def within_model(pts: list[Point], named: bool = False) -> tuple[list[Point], list[Point], str]:
    """One model's layers split in two: fit on the first half × WikiText-2 cells, applied to the
    second half × C4 cells (no point in both)."""
    layers = sorted({p.layer for p in pts})
    first = set(layers[: len(layers) // 2])
    fit = [p for p in pts if p.layer in first and p.cell.startswith("wikitext2")]
    held = [p for p in pts if p.layer not in first and p.cell.startswith("c4")]
    return (
        fit,
        held,
        (
            (f"{pts[0].model}: " if named else "")
            + f"fit on layers {min(first)}–{max(first)} × WikiText-2 cells, applied "
            f"to layers {min(set(layers) - first)}–{max(layers)} × C4 cells"
        ),
    )


def splits(pts: list[Point]) -> list[tuple[list[Point], list[Point], str]]:
    """The paper's protocol first — γ fitted on every layer and cell of one model, applied
    unchanged to another, in both directions — then each model's within-model split."""
    models = list(dict.fromkeys(p.model for p in pts))
    out = [
        (
            [p for p in pts if p.model == a],
            [p for p in pts if p.model == b],
            f"fit on {a}, applied to {b}",
        )
        for a in models
        for b in models
        if a != b
    ]
    named = len(models) > 1
    return out + [within_model([p for p in pts if p.model == m], named) for m in models]


def split(pts: list[Point]) -> tuple[list[Point], list[Point], str]:
    """The first split of `splits` (across models when there are two)."""
    return splits(pts)[0]


def _base(p: Point, predictor: str) -> float:
    return {"full": p.log_t + p.log_a, "trace-only": p.log_t, "cache-error-only": 0.0}[predictor]


def spearman(a, b) -> float:
    """Rank correlation (continuous values: ties are not expected)."""
    ra = np.argsort(np.argsort(np.asarray(a)))
    rb = np.argsort(np.argsort(np.asarray(b)))
    return float(np.corrcoef(ra, rb)[0, 1])


def fit_and_evaluate(fit: list[Point], held: list[Point], description: str) -> dict:
    """γ per predictor on the fit set, and its errors on the evaluation set."""
    results = {"split": description, "n_fit": len(fit), "n_eval": len(held), "predictors": {}}
    for predictor in PREDICTORS:
        gamma = float(np.mean([p.y - _base(p, predictor) for p in fit]))
        pred = np.array([_base(p, predictor) + gamma for p in held])
        obs = np.array([p.y for p in held])
        err = pred - obs
        results["predictors"][predictor] = {
            "gamma": gamma,
            "mae": float(np.abs(err).mean()),
            "rmse": float(np.sqrt((err**2).mean())),
            "spearman": spearman(pred, obs) if predictor != "cache-error-only" else float("nan"),
            "sign_agreement": float((np.sign(pred) == np.sign(obs)).mean()),
        }
    return results


def all_predictions(records: list[dict]) -> list[dict]:
    return [fit_and_evaluate(*s) for s in splits(points(records))]


def predictions(records: list[dict]) -> dict:
    """The first split's γ and errors (across models when the records hold two)."""
    return all_predictions(records)[0]


def table5_rows(records: list[dict]) -> list[list[str]]:
    rows = [
        [
            "predictor of log(G_P/G_C)",
            "γ (fit)",
            "MAE",
            "RMSE",
            "Spearman",
            "sign agreement",
            "split",
        ]
    ]
    for res in all_predictions(records):
        for name, r in res["predictors"].items():
            rows.append(
                [
                    name,
                    f"{r['gamma']:+.3f}",
                    f"{r['mae']:.3f}",
                    f"{r['rmse']:.3f}",
                    "—" if np.isnan(r["spearman"]) else f"{r['spearman']:.3f}",
                    f"{r['sign_agreement']:.2f}",
                    f"{res['split']} ({res['n_fit']} / {res['n_eval']} points)",
                ]
            )
    return rows


def interventions(records: list[dict], layer: int | None = None) -> dict:
    """Per model: median gain ratio of each equal-energy intervention over all points and draws,
    the mean at one layer (paper: 20; else the middle layer), and the JVP-vs-finite Spearman."""
    out = {}
    for r in _records(records):
        model = r["config"]["model"]["name"]
        entry = out.setdefault(model, {"ratios": {}, "layer_ratios": {}, "jvp": [], "fd": []})
        m = r["metrics"]
        layers = m["probes/layers"]
        chosen = layer if layer in layers else (20 if 20 in layers else layers[len(layers) // 2])
        entry["layer"] = chosen
        for kind in ("signs", "permutation", "isotropic"):
            for i, draws in enumerate(m.get(f"probes/ratio_{kind}", [])):
                entry["ratios"].setdefault(kind, []).extend(draws)
                if layers[i] == chosen:
                    entry["layer_ratios"].setdefault(kind, []).extend(draws)
        for layer_obs in m["probes/observations"]:
            for _, _, g_jvp, g_fd in layer_obs:
                entry["jvp"].append(g_jvp)
                entry["fd"].append(g_fd)
    for entry in out.values():
        entry["median"] = {k: float(np.median(v)) for k, v in entry["ratios"].items()}
        entry["at_layer"] = {k: float(np.mean(v)) for k, v in entry["layer_ratios"].items()}
        entry["spearman"] = spearman(entry["jvp"], entry["fd"])
        entry["n_observations"] = len(entry["jvp"])
    return out


def table6_rows(records: list[dict], paper: dict | None = None) -> list[list[str]]:
    paper = paper or {}
    rows = [
        [
            "model",
            "layer",
            "signs (layer)",
            "permutation (layer)",
            "isotropic (layer)",
            "median signs",
            "median permutation",
            "median isotropic",
            "JVP vs finite Spearman",
        ]
    ]
    for model, e in interventions(records).items():
        stated = paper.get(model, {})

        def cite(text, key, stated=stated):
            return f"{text} (paper {stated[key]})" if key in stated else text

        rows.append(
            [
                model,
                str(e["layer"]),
                f"{e['at_layer'].get('signs', float('nan')):.3f}×",
                cite(
                    f"{e['at_layer'].get('permutation', float('nan')):.3f}×",
                    "permutation_gain_layer20",
                ),
                f"{e['at_layer'].get('isotropic', float('nan')):.3f}×",
                f"{e['median'].get('signs', float('nan')):.3f}×",
                cite(
                    f"{e['median'].get('permutation', float('nan')):.3f}×",
                    "median_permutation_gain",
                ),
                f"{e['median'].get('isotropic', float('nan')):.3f}×",
                cite(f"{e['spearman']:.3f} ({e['n_observations']} obs.)", "jvp_spearman"),
            ]
        )
    for model in sorted(set(paper) - {row[0] for row in rows}):  # a twin: the paper's beside ours
        stated = paper[model]
        rows.append([f"{model} (paper)", "20" if "permutation_gain_layer20" in stated else "—"] + [
            f"{stated[key]:.3f}×" if key in stated else "—"
            for key in (None, "permutation_gain_layer20", None, None, "median_permutation_gain", None)
        ] + [f"{stated['jvp_spearman']:.3f}" if "jvp_spearman" in stated else "—"])  # fmt: skip
    return rows


def allocation(records: list[dict]) -> dict[str, np.ndarray]:
    """Per model, one row per layer and cell: A_C, O_C, the isotropic ratio they predict,
    1 / (A_C + O_C), and the measured one (median over draws). An isotropic direction has A = 1
    and O ≈ 0 in expectation, so `G = T(A + O)` predicts its gain relative to the QDQ direction as
    1 / (A_C + O_C); A_C < 1 means the QDQ error sits on less sensitive coordinates than average."""
    by_model: dict[str, list] = {}
    for r in _records(records):
        m = r["metrics"]
        measured = np.median(np.asarray(m["probes/ratio_isotropic"], dtype=float), axis=1)
        for a, o, iso in zip(m["probes/A_content"], m["probes/O_content"], measured):
            by_model.setdefault(r["config"]["model"]["name"], []).append((a, o, 1 / (a + o), iso))
    return {model: np.asarray(pts) for model, pts in by_model.items()}


def allocation_rows(records: list[dict]) -> list[list[str]]:
    """Why an equal-energy redistribution of the content error does (not) raise its gain: the
    predicted isotropic ratio 1 / (A_C + O_C) beside the measured one (`allocation`)."""
    rows = [
        [
            "model",
            "A_C median (range)",
            "O_C median",
            "predicted isotropic ratio 1/(A_C+O_C), median",
            "measured isotropic ratio, median",
            "Spearman (predicted vs measured)",
            "points",
        ]
    ]
    for model, a in allocation(records).items():
        rows.append(
            [
                model,
                f"{np.median(a[:, 0]):.3f} ({a[:, 0].min():.3f}–{a[:, 0].max():.3f})",
                f"{np.median(a[:, 1]):+.3f}",
                f"{np.median(a[:, 2]):.3f}×",
                f"{np.median(a[:, 3]):.3f}×",
                f"{spearman(a[:, 2], a[:, 3]):.3f}",
                str(len(a)),
            ]
        )
    return rows


def layer_rows(records: list[dict]) -> list[list[str]]:
    """Per model and layer (means over cells; the interventions' medians over cells and draws): the
    path ratios of Table 5's predictor, the content error's allocation and the gains it predicts,
    then each model's medians over every layer and cell and, over layers, how the permutation's
    gain ranks with 1 / (A_C + O_C)."""
    rows = [[
        "model", "layer", "G_P/G_C", "T_P/T_C", "A_P/A_C", "A_C", "O_C", "1/(A_C+O_C)",
        "isotropic", "permutation", "Spearman over layers (permutation vs 1/(A_C+O_C))",
    ]]  # fmt: skip
    by_model: dict[str, dict[int, dict[str, list]]] = {}
    for r in _records(records):
        m = r["metrics"]
        layers = by_model.setdefault(r["config"]["model"]["name"], {})
        for i, layer in enumerate(m["probes/layers"]):
            found = layers.setdefault(layer, {})
            for name, value in (
                ("g", m["probes/G_rope"][i] / m["probes/G_content"][i]),
                ("t", m["probes/T_rope"][i] / m["probes/T_content"][i]),
                ("a", m["probes/A_rope"][i] / m["probes/A_content"][i]),
                ("a_c", m["probes/A_content"][i]),
                ("o_c", m["probes/O_content"][i]),
                ("inv", 1 / (m["probes/A_content"][i] + m["probes/O_content"][i])),
            ):
                found.setdefault(name, []).append(value)
            for kind in ("isotropic", "permutation"):
                found.setdefault(kind, []).extend(m[f"probes/ratio_{kind}"][i])

    def line(model, layer, v, mean, rho=""):
        return [model, layer, *(f"{mean(v[k]):.2f}" for k in ("g", "t", "a", "a_c")),
                f"{mean(v['o_c']):+.2f}", *(f"{f(v[k]):.2f}×" for k, f in
                (("inv", mean), ("isotropic", np.median), ("permutation", np.median))), rho]  # fmt: skip

    for model, layers in by_model.items():
        rows += [line(model, str(layer), v, np.mean) for layer, v in sorted(layers.items())]
        pooled = {k: sum((v[k] for v in layers.values()), []) for k in next(iter(layers.values()))}
        rho = spearman(
            [np.median(v["permutation"]) for v in layers.values()],
            [np.mean(v["inv"]) for v in layers.values()],
        )
        rows.append(line(model, "median", pooled, np.median, f"{rho:.2f}"))
    return rows


def fig7(records: list[dict], out: Path, stem: str) -> list:
    """(a) predicted vs observed log(G_P/G_C), fit and evaluation points; (b) intervention gain
    ratios; (c) JVP vs finite-perturbation gains."""
    plt = pyplot()
    res = predictions(records)
    pts = points(records)
    fit, held, _ = split(pts)
    gamma = res["predictors"]["full"]["gamma"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    for group, style, label in ((fit, "C0o", "fit"), (held, "C3s", "evaluation")):
        a.plot(
            [p.y for p in group],
            [p.log_t + p.log_a + gamma for p in group],
            style,
            ms=4,
            label=label,
        )
    lim = [min(p.y for p in pts) - 0.3, max(p.y for p in pts) + 0.3]
    a.plot(lim, lim, "k--", lw=0.8)
    a.set_xlabel("observed log(G_P/G_C)")
    a.set_ylabel("log(T_P/T_C) + log(A_P/A_C) + γ")
    a.set_title(f"γ = {gamma:+.3f}, eval MAE {res['predictors']['full']['mae']:.3f}", fontsize=9)
    a.legend(fontsize=7)
    inter = interventions(records)
    kinds = ("signs", "permutation", "isotropic")
    data, labels = [], []
    for model, e in inter.items():
        for k in kinds:
            if k in e["ratios"]:
                data.append(e["ratios"][k])
                labels.append(f"{k}\n{model}" if len(inter) > 1 else k)
    b.boxplot(data, tick_labels=labels)
    b.axhline(1.0, color="gray", ls="--", lw=0.8)
    b.set_yscale("log")
    b.set_ylabel("content gain ratio G(e′)/G(e), equal energy")
    b.tick_params(axis="x", labelsize=7, labelrotation=20)
    for model, e in inter.items():
        c.loglog(e["fd"], e["jvp"], "o", ms=3, label=f"{model} (ρ = {e['spearman']:.3f})")
    c.set_xlabel("finite-perturbation gain")
    c.set_ylabel("JVP gain")
    c.legend(fontsize=7)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    fig.suptitle("Fig. 7 — operator analysis at cache NMSE 1e-3")
    return save(fig, out, stem)
