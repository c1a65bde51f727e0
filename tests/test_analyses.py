"""The two path analyses (docs/method.md §7–§8) against explicit float64 references on a layer small enough
for its whole Jacobian, their bad inputs, and the aggregates built from their records."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from analysis import probes as probe_tables
from analysis import sensitivity as sens_tables
from quantmla.calibration.objectives import layer_output
from quantmla.errors import ConfigError
from quantmla.evaluation.studies.layer_study import (
    capture_cell,
    layer_cell,
    qdq_error,
    rescale_to_nmse,
)
from quantmla.evaluation.studies.probes import decomposition, directional_gain, hessian_diagonal
from quantmla.evaluation.studies.sensitivity import finite_response
from quantmla.models.adapters import get_adapter
from quantmla.models.tiny import tiny_mla_config
from quantmla.spec import QuantizerSpec
from tests.conftest import needs_tiny, run_config

SPEC = QuantizerSpec(4, 4, group_size=16)


@pytest.fixture(scope="module")
def small_layer():
    """One float64 MLA layer (hidden 32, d_c 32, d_r 16), 2 sequences of 6 tokens: J is 384 × 384."""
    torch.manual_seed(0)
    config = tiny_mla_config(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=32,
    )
    model = AutoModelForCausalLM.from_config(config).double().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    store = capture_cell(model, modules, torch.randint(0, 64, (2, 6)), batch_size=2)
    return layer_cell(store, 0, modules[0], adapter)


@pytest.mark.parametrize("path", ["C", "P"])
def test_gain_decomposition_matches_the_explicit_jacobian(small_layer, path):
    cell = small_layer
    x = cell.cached(path)
    e = rescale_to_nmse(qdq_error(SPEC, path, x), x, 1e-3)

    def f(v):
        return cell.output(path, v)

    jac = torch.autograd.functional.jacobian(f, x).reshape(cell.y.numel(), x.numel())
    h = jac.T @ jac
    ev = e.reshape(-1)
    trace_mean = float(h.diagonal().mean())
    a_explicit = float((h.diagonal() * ev**2).sum() / (trace_mean * ev @ ev))
    o_explicit = float((ev @ h @ ev - (h.diagonal() * ev**2).sum()) / (trace_mean * ev @ ev))
    gain = directional_gain(f, x, e)
    assert gain == pytest.approx(
        float(ev @ h @ ev / (ev @ ev)), rel=1e-12
    )  # JVP = Rayleigh quotient
    assert gain == pytest.approx(
        trace_mean * (a_explicit + o_explicit), rel=1e-10, abs=0
    )  # G = T(A + O)
    exact = decomposition(h.diagonal().reshape(x.shape), e, gain)
    assert exact["T"] == pytest.approx(trace_mean, rel=1e-12)
    assert exact["A"] == pytest.approx(a_explicit, rel=1e-12)
    assert exact["O"] == pytest.approx(o_explicit, rel=1e-8, abs=1e-12)


def test_probe_estimates_converge_like_one_over_sqrt_probes(small_layer):
    cell = small_layer
    x = cell.cached("C")

    def f(v):
        return cell.output("C", v)

    jac = torch.autograd.functional.jacobian(f, x).reshape(cell.y.numel(), x.numel())
    diag = (jac**2).sum(dim=0).reshape(x.shape)
    errors = {}
    for n in (16, 256):
        trials = [
            hessian_diagonal(f, x, n, 16, torch.Generator().manual_seed(seed)) for seed in range(6)
        ]
        errors[n] = (
            np.mean([float((t.sum() - diag.sum()).abs() / diag.sum()) for t in trials]),
            np.mean([float((t - diag).norm() / diag.norm()) for t in trials]),
        )
    # 16× the probes: errors shrink ~4× (1/√probes); asserted > 2× for the (noisier) trace,
    # > 3× for the diagonal, over 6 seeds
    assert errors[256][0] < errors[16][0] / 2 and errors[256][1] < errors[16][1] / 3, errors
    assert errors[256][0] < 0.05 and errors[256][1] < 0.15


def test_finite_response_against_the_expanded_form(small_layer):
    """R from the study equals NMSE_out / 0.01 computed independently with the expanded form."""
    cell = small_layer
    for path in ("C", "P"):
        x = cell.cached(path)
        e = rescale_to_nmse(qdq_error(SPEC, path, x), x, 0.01)
        assert float(e.pow(2).sum() / x.pow(2).sum()) == pytest.approx(0.01, rel=1e-12)
        replace = {"c": x + e} if path == "C" else {"k_rot": x + e}
        y = layer_output(cell.module, cell.adapter, cell.proj)
        y_hat = layer_output(cell.module, cell.adapter, cell.proj, **replace)
        reference = float((y_hat - y).pow(2).sum() / y.pow(2).sum()) / 0.01
        assert finite_response(cell, path, SPEC, 0.01) == pytest.approx(reference, rel=1e-9)


@needs_tiny
@pytest.mark.parametrize(
    "override,expected",
    [
        ("eval.layers=[6]", "eval.layers=6 is not allowed; allowed: layer indices in 0..5"),
        ("eval.paths=[C,X]", "eval.paths='X' is not allowed"),
        ("eval.target_nmse=0", "eval.target_nmse=0.0 is not allowed"),
        ("eval.datasets=[wikitext2,c4]", "exactly one dataset per job"),
    ],
)
def test_bad_study_settings_stop_before_loading(override, expected, tmp_path, monkeypatch):
    import quantmla.prepare
    from quantmla.run import run

    monkeypatch.setattr(quantmla.prepare, "prepare", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[")):
        run(
            run_config("eval=sensitivity", override, "logger=none", f"paths.results_dir={tmp_path}")
        )


def test_too_few_probes_stop(tmp_path):
    from quantmla.job import resolve as validate

    with pytest.raises(ConfigError, match="eval.probes=1 is not allowed; allowed: at least 2"):
        validate(run_config("eval=probes", "eval.probes=1", f"paths.results_dir={tmp_path}"))


def test_hub_checkpoint_offline_stops_in_one_line(tmp_path, monkeypatch):
    from quantmla.errors import DataNotFoundError
    from quantmla.job import resolve as validate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        DataNotFoundError, match="model.path='deepseek-ai/DeepSeek-V2-Lite' is a hub id"
    ):
        validate(
            run_config(
                "experiment=fig2_sensitivity",
                "model=deepseek_v2_lite",
                f"paths.results_dir={tmp_path}",
            )
        )


def _sens_record(model, dataset, seed, rc, rp):
    return {
        "config": {"model": {"name": model}, "eval": {"datasets": [dataset]}, "seed": seed},
        "metrics": {
            "sensitivity/layers": list(range(len(rc))),
            "sensitivity/R_content": rc,
            "sensitivity/R_rope": rp,
        },
    }


def test_model_ratio_is_ratio_of_means_not_mean_of_ratios():
    records = [
        _sens_record("m", "wikitext2", 0, [1.0, 0.1], [0.5, 0.4]),
        _sens_record("m", "c4", 0, [3.0, 0.3], [1.5, 0.2]),
    ]
    (m,) = sens_tables.aggregate(records)
    assert np.allclose(m.mean_content, [2.0, 0.2]) and np.allclose(m.mean_rope, [1.0, 0.3])
    assert m.model_ratio == pytest.approx(1.3 / 2.2)
    assert np.allclose(m.layer_ratio, [0.5, 1.5]) and m.model_ratio != pytest.approx(1.0)
    rows = sens_tables.table4_rows(records)
    assert rows[1][5] == f"**{1.3 / 2.2:.3f}**" and rows[1][8] == "1/2"


def test_gamma_split_is_disjoint_and_exact_when_the_model_holds():
    """With y = t + a + γ exactly, the full predictor transfers with zero error."""
    records = _probe_records("m", 0.3, 0)
    fit, held, _ = probe_tables.split(probe_tables.points(records))
    assert fit and held and not {(p.cell, p.layer) for p in fit} & {(p.cell, p.layer) for p in held}
    res = probe_tables.predictions(records)["predictors"]
    assert res["full"]["gamma"] == pytest.approx(0.3) and res["full"]["mae"] < 1e-12
    assert res["trace-only"]["mae"] > 0.01


def test_study_figures_draw_from_records(tmp_path):
    from analysis.figures import _figures

    sens = [
        _sens_record("m", d, s, [1.0 + s, 0.1], [0.5, 0.4 + s])
        for d in ("wikitext2", "c4")
        for s in (0, 1)
    ]
    probe_records = []
    for dataset in ("wikitext2", "c4"):
        metrics = {"probes/layers": [0, 1]}
        for key in ("G", "T", "A", "Gfd"):
            for path in ("content", "rope"):
                metrics[f"probes/{key}_{path}"] = [0.5, 2.0] if path == "rope" else [1.0, 1.5]
        metrics["probes/observations"] = [
            [["content", "qdq", 1.0, 1.1], ["rope", "qdq", 0.5, 0.4]]
        ] * 2
        for kind in ("signs", "permutation", "isotropic"):
            metrics[f"probes/ratio_{kind}"] = [[1.0, 1.2], [0.9, 1.1]]
        probe_records.append(
            {
                "config": {"model": {"name": "m"}, "eval": {"datasets": [dataset]}, "seed": 0},
                "metrics": metrics,
            }
        )
    figures = _figures()
    for name, records in (("fig2", sens), ("fig6", sens), ("fig7", probe_records)):
        draw, default = figures[name]
        paths = draw(records, tmp_path, f"tiny_{default}", default)
        assert all(p.stat().st_size > 1000 for p in paths)


def _probe_records(model: str, gamma: float, seed: int) -> list[dict]:
    """Records whose gains obey log(G_P/G_C) = log(T_P/T_C) + log(A_P/A_C) + gamma exactly."""
    rng, records = np.random.default_rng(seed), []
    for dataset in ("wikitext2", "c4"):
        m = {k: [] for k in ("G_content", "G_rope", "T_content", "T_rope", "A_content", "A_rope")}
        for _ in range(4):
            t_c, t_p, a_c, a_p = rng.uniform(0.5, 2.0, 4)
            m["T_content"].append(t_c), m["T_rope"].append(t_p)
            m["A_content"].append(a_c), m["A_rope"].append(a_p)
            m["G_content"].append(t_c * a_c), m["G_rope"].append(t_p * a_p * np.exp(gamma))
        metrics = {f"probes/{k}": v for k, v in m.items()} | {"probes/layers": [0, 1, 2, 3]}
        records.append(
            {
                "config": {"model": {"name": model}, "eval": {"datasets": [dataset]}, "seed": 0},
                "metrics": metrics,
            }
        )
    return records


def test_gamma_transfers_across_models_in_both_directions_then_within_each():
    """The paper's protocol (fit on one model, apply unchanged to the other) both ways, then each
    model's own split: a γ offset between the models is the transfer error, exactly."""
    records = _probe_records("a", 0.3, 0) + _probe_records("b", 0.5, 1)
    results = probe_tables.all_predictions(records)
    assert [r["split"] for r in results] == [
        "fit on a, applied to b",
        "fit on b, applied to a",
        results[2]["split"],
        results[3]["split"],
    ]
    assert results[2]["split"].startswith("a: fit on layers") and results[3]["split"].startswith(
        "b:"
    )
    a_to_b, b_to_a = (r["predictors"]["full"] for r in results[:2])
    assert a_to_b["gamma"] == pytest.approx(0.3) and a_to_b["mae"] == pytest.approx(0.2)
    assert b_to_a["gamma"] == pytest.approx(0.5) and b_to_a["mae"] == pytest.approx(0.2)
    assert all(r["predictors"]["full"]["mae"] < 1e-12 for r in results[2:])
    rows = probe_tables.table5_rows(records)
    assert len(rows) == 1 + 4 * len(probe_tables.PREDICTORS)


def test_allocation_table_predicts_the_isotropic_ratio_from_a_and_o():
    """1 / (A_C + O_C) is the isotropic direction's gain ratio when the decomposition holds."""
    records = _probe_records("m", 0.3, 0)
    for r in records:
        m = r["metrics"]
        m["probes/O_content"] = [0.1, -0.2, 0.3, 0.0]
        m["probes/ratio_isotropic"] = [
            [1 / (a + o)] * 3 for a, o in zip(m["probes/A_content"], m["probes/O_content"])
        ]
    header, row = probe_tables.allocation_rows(records)
    assert header[0] == "model" and row[0] == "m" and row[-1] == "8"
    assert row[3] == row[4] and row[5] == "1.000"


def test_a_table6_twin_shows_the_papers_interventions_beside_its_own():
    records = _probe_records("m", 0.3, 0)
    for r in records:
        m = r["metrics"]
        for kind in ("signs", "permutation", "isotropic"):
            m[f"probes/ratio_{kind}"] = [[1.5, 2.5]] * 4
        m["probes/observations"] = [[[0, 0, 1.0, 1.0], [0, 1, 2.0, 2.0]]] * 4
    paper = {"v2": {"permutation_gain_layer20": 5.918, "jvp_spearman": 0.986}, "glm": {}}
    header, ours, glm, v2 = probe_tables.table6_rows(records, paper)
    assert ours[0] == "m" and ours[3] == "2.000×" and ours[6] == "2.000×"  # its middle layer, 2
    assert v2 == ["v2 (paper)", "20", "—", "5.918×", "—", "—", "—", "—", "0.986"]
    assert glm[0] == "glm (paper)" and set(glm[1:]) == {"—"}


def test_the_per_layer_table_averages_cells_and_ranks_the_permutation_with_the_allocation():
    """Two cells of four layers: each layer's ratios are the cells' means, its gains the medians
    of every draw; the permutation's gain set to 1/(A_C + O_C) ranks with it exactly."""
    records = _probe_records("m", 0.3, 0)
    for r in records:
        m = r["metrics"]
        m["probes/O_content"] = [0.0, 0.1, 0.2, 0.3]
        inverse = [1 / (a + o) for a, o in zip(m["probes/A_content"], m["probes/O_content"])]
        m["probes/ratio_isotropic"] = [[x, x] for x in inverse]
        m["probes/ratio_permutation"] = [[2 * x, 2 * x] for x in inverse]
    header, *layers, median = probe_tables.layer_rows(records)
    assert [row[1] for row in layers] == ["0", "1", "2", "3"] and median[1] == "median"
    a, b = (r["metrics"] for r in records)
    t_ratio = np.mean([m["probes/T_rope"][2] / m["probes/T_content"][2] for m in (a, b)])
    assert layers[2][3] == f"{t_ratio:.2f}" and layers[2][6] == "+0.20"
    g_ratio = np.mean([m["probes/G_rope"][2] / m["probes/G_content"][2] for m in (a, b)])
    assert layers[2][2] == f"{g_ratio:.2f}"
    # the isotropic gain's median is a median of draws, not of the cells' means
    draws = [m["probes/ratio_isotropic"][1][0] for m in (a, b)]
    assert layers[1][8] == f"{np.median(draws):.2f}×"
    assert median[-1] == "1.00" and all(row[-1] == "" for row in layers)


def _nmse_record(precision, method, layers, created="2026-12-05"):
    return {
        "created": created,
        "config": {"model": {"name": "m"}, "precision": {"name": precision},
                   "method": {"name": method}},
        "metrics": {"nmse/attn_layers": layers},
    }  # fmt: skip


def test_layer_nmse_counts_each_methods_lowest_layers_and_draws(tmp_path):
    from analysis import layer_nmse

    records = [
        _nmse_record("c4r4", "rtn", [4e-3, 1e-3, 9e-3]),
        _nmse_record("c4r4", "quarot", [2e-3, 1e-4, 3e-3]),
        _nmse_record("c4r4", "quantmla", [1e-3, 5e-4, 1e-3]),
        _nmse_record(
            "c4r4", "quantmla", [9e-1, 9e-1, 9e-1], created="2026-12-01"
        ),  # older: not shown
        _nmse_record("c2r4", "rtn", [1e-1, 2e-1, 3e-1]),
        _nmse_record("bf16", "rtn", [0.0, 0.0, 0.0]),
        _nmse_record("mixed", "rtn", [1e-2, 1e-2, 1e-2]),  # a format per layer: no row
        _nmse_record("cnvfp4re4m3t", "rtn", [1e-3, 1e-3, 1e-3]),
    ]
    rows = layer_nmse.layer_rows(records)
    assert [r[:2] for r in rows if r[0] == "CNVFP4RE4M3T"] == [["CNVFP4RE4M3T", "RTN"]]
    rows = [r for r in rows if r[0] != "CNVFP4RE4M3T"]  # an engine format has its row too
    assert [r[:2] for r in rows[1:]] == [["C4R4", "RTN"], ["C4R4", "QuaRot†"], ["C4R4", "QuantMLA"],
                                         ["C2R4", "RTN"]]  # fmt: skip
    rtn, quarot, ours, c2 = rows[1:]
    assert ours[2] == f"{np.mean([1e-3, 5e-4, 1e-3]):.3e}" and ours[4] == "1.000e-03 (0)"
    assert (rtn[5], quarot[5], ours[5]) == ("0 of 3", "1 of 3", "2 of 3")
    assert (rtn[6], quarot[6], ours[6], c2[6]) == ("3 of 3", "2 of 3", "—", "—")
    written = layer_nmse.fig_layer_nmse(records, tmp_path, "layers")
    assert [p.name for p in written] == ["layers.png", "layers.pdf"]


def test_rope_objective_rows_set_each_quantmla_fit_beside_quarot():
    from analysis import rope_objective

    def record(precision, method, layers, objective=None, experiment="smol_table1", seqlen=512,
               moved=0, hadamard=False):  # fmt: skip
        cal = {"seqlen": seqlen, **({"rope_objective": objective} if objective else {})}
        cal |= ({"rope_positions": moved} if moved else {}) | (
            {"rope_hadamard": True} if hadamard else {}
        )
        return {
            "experiment": experiment,
            "config": {"model": {"name": "smol_mla"}, "precision": {"name": precision},
                       "method": {"name": method, "calibration": cal}, "eval": {"kind": "perplexity"}},
            "metrics": {"ppl/wikitext2": 20.0 + layers[0], "ppl/c4": 23.0, "nmse/attn_mean": float(np.mean(layers)),
                        "nmse/attn_layers": layers},
        }  # fmt: skip

    rows = rope_objective.rope_objective_rows([
        record("c16r4", "quarot", [2.0, 2.0, 2.0], experiment="smol_path_split"),
        record("c16r4", "quantmla", [3.0, 1.0, 3.0], experiment="smol_path_split"),
        record("c16r4", "quantmla", [1.0, 1.0, 3.0], "output", experiment="smol_rope_objective"),
        record("c16r4", "quantmla", [0.0, 0.0, 0.0], experiment="elsewhere"),  # not these experiments
        record("c16r4", "quantmla", [1.0, 3.0, 1.0], experiment="smol_rope_seqlen", seqlen=2048),
        record("c16r4", "quantmla", [1.0, 1.0, 1.0], experiment="smol_rope_moved", moved=2048),
        record("c16r4", "quantmla", [1.5, 2.5, 0.5], experiment="smol_rope_hadamard", hadamard=True),
        record("cmxfp4rmxfp4", "quarot", [2.0, 2.0, 2.0], experiment="smol_frontier"),
        record("cmxfp4rmxfp4", "quantmla", [3.0, 3.0, 1.0], experiment="smol_frontier"),
        record("cmxfp4rmxfp4", "quantmla", [1.0, 3.0, 1.0], experiment="smol_path_split"),  # not read
        record("cmxfp4rmxfp4", "quantmla", [1.0, 1.0, 3.0], experiment="smol_rope_hadamard", hadamard=True),
    ])  # fmt: skip
    c16 = rows[1:7]
    assert [r[5] for r in c16] == ["—", "1 of 3", "2 of 3", "2 of 3", "3 of 3", "2 of 3"]
    assert c16[2][2] == "21.000" and c16[1][4] == f"{7 / 3:.3e}" and c16[5][2] == "21.500"
    assert rows[7][2:] == ["—"] * 4  # C4R4's QuaRot†: no record
    mxfp4 = [r for r in rows if r[0] == "CMXFP4RMXFP4"]  # its three rows only
    assert [r[5] for r in mxfp4] == ["—", "1 of 3", "2 of 3"] and mxfp4[1][2] == "23.000"


def test_rope_position_rows_count_layers_below_quarot_per_key_range():
    from analysis import rope_positions

    def record(method, errors, seqlen=None):
        cal = {"seqlen": seqlen} if seqlen else {}
        return {
            "config": {"precision": {"name": "c16r4"}, "method": {"name": method, "calibration": cal},
                       "eval": {"kind": "rope_positions"}},
            "metrics": {"rope_positions/edges": [0, 2, 4], "rope_positions/qk_error": errors},
        }  # fmt: skip

    rows = rope_positions.rope_position_rows([
        record("quantmla", [[1.0, 4.0], [1.0, 2.0]], seqlen=512),
        record("quarot", [[2.0, 2.0], [2.0, 3.0]]),
        record("rtn", [[5.0, 5.0], [5.0, 5.0]]),
    ])  # fmt: skip
    assert rows[0] == ["precision", "cache", "keys 0–1", "keys 2–3"]
    assert [r[1] for r in rows[1:]] == [
        "RTN", "QuaRot† (online Hadamard)", "QuantMLA (fitted on 512-token sequences)",
    ]  # fmt: skip
    assert rows[3][2:] == ["1.000e+00 (2 of 2 below QuaRot†)", "3.000e+00 (1 of 2 below QuaRot†)"]
    assert rows[2][2:] == ["2.000e+00", "2.500e+00"] and rows[1][3].endswith(
        "(0 of 2 below QuaRot†)"
    )


def answer_record(precision, method, loglik, exact=(0.0,) * 4, created="2026-12-05"):
    """An eval=ruler_answer record: four S-NIAH-3 samples, two at each of two lengths."""
    halves = {512: slice(0, 2), 1024: slice(2, 4)}
    docs = {f"docs/ruler_answer/s_niah_3/{n}/{k}": list(v[s]) for n, s in halves.items()
            for k, v in (("loglik", loglik), ("exact", exact))}  # fmt: skip
    return {
        "created": created,
        "config": {"precision": {"name": precision}, "method": {"name": method},
                   "eval": {"kind": "ruler_answer", "tasks": ["s_niah_3"], "context_lengths": [512, 1024]}},
        "metrics": docs,
    }  # fmt: skip


def test_ruler_answer_rows_pair_each_cache_with_bf16_over_the_same_samples():
    from analysis import ruler_answer

    rows = ruler_answer.answer_rows([
        answer_record("bf16", "quantmla", [-1.0, -2.0, -3.0, -4.0], [1.0, 1.0, 0.0, 1.0]),
        answer_record("c4r4", "rtn", [-2.0, -2.0, -5.0, -4.0], [0.0, 1.0, 1.0, 1.0]),
        answer_record("c4r4", "rtn", [0.0, 0.0, 0.0, 0.0], [1.0] * 4, created="2026-12-01"),  # older
    ])  # fmt: skip
    assert [r[1:3] for r in rows[1:]] == [["BF16", "—"], ["C4R4", "RTN"]]
    d = np.array([-1.0, 0.0, -2.0, 0.0])
    assert rows[2][3:] == [
        "75.0", "-3.250", f"{d.mean():+.3f} ± {d.std(ddof=1) / 2:.3f}", "2 of 4", "1 / 1",
    ]  # fmt: skip
    assert rows[1][5:] == ["—", "—", "—"]


def test_ruler_answer_paths_split_each_methods_loss_and_pair_the_methods():
    from analysis import ruler_answer

    bf16 = np.array([-1.0, -2.0, -3.0, -4.0])
    change = {  # (method, precision) → each sample's log-likelihood change from BF16
        ("rtn", "c4r16"): np.array([-1.0, 0.0, -2.0, -1.0]),
        ("rtn", "c16r4"): np.array([-2.0, -3.0, -2.0, -5.0]),
        ("rtn", "c4r4"): np.array([-3.0, -4.0, -5.0, -6.0]),
        ("quantmla", "c4r16"): np.array([0.0, 0.0, -0.5, 0.0]),
        ("quantmla", "c16r4"): np.array([-1.0, -2.0, -2.0, -3.0]),
        ("quantmla", "c4r4"): np.array([-1.0, -2.0, -3.0, -3.0]),
    }
    records = [answer_record("bf16", "rtn", bf16)]
    records += [answer_record(p, m, bf16 + d) for (m, p), d in change.items()]
    rows = ruler_answer.path_rows(records)

    def ms(d):  # float64 reference: the paired mean and its standard error
        return f"{d.mean():+.3f} ± {d.std(ddof=1) / 2:.3f}"

    assert rows[1][:2] == ["S-NIAH-3", "RTN"] and rows[2][1] == "QuantMLA"
    for row, m in ((rows[1], "rtn"), (rows[2], "quantmla")):
        c = {p: change[(m, p)] for p in ("c4r16", "c16r4", "c4r4")}
        assert row[2:6] == [ms(c["c4r16"]), ms(c["c16r4"]), ms(c["c4r4"]),
                            ms(c["c4r4"] - c["c4r16"] - c["c16r4"])]  # fmt: skip
        halves = c["c16r4"][:2].mean(), c["c16r4"][2:].mean()
        assert row[6] == f"{halves[0]:+.2f} / {halves[1]:+.2f} (512, 1024)"
    gain = change[("quantmla", "c16r4")] - change[("rtn", "c16r4")]
    assert rows[3][1] == "QuantMLA − RTN" and rows[3][3] == f"{ms(gain)} (3 of 4 higher)"
    # a method without every path is left out, and so is the comparison
    assert [r[1] for r in ruler_answer.path_rows(records[:-1])[1:]] == ["RTN"]
