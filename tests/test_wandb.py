"""W&B dashboards, offline: jobs and regenerated artifacts logged, then read back from the run files
W&B wrote (its own protobuf records, its table and media files) — never from what we sent."""

import json
import subprocess
import sys

import pytest

from quantmla.tracking.wandb_mirror import layout, split_paper_columns
from tests.conftest import DATA_DIR, REPO, needs_tiny, run_config
from tests.wandb_files import offline_runs


@pytest.fixture
def wandb_dirs(tmp_path, monkeypatch):
    """Every W&B file of the test under tmp_path: runs, staged artifacts, cache."""
    for var, sub in (
        ("WANDB_DIR", "runs"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CACHE_DIR", "cache"),
    ):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    import wandb

    wandb.teardown()  # W&B reads its directories from the environment once per setup
    yield tmp_path
    wandb.teardown()


def job(tmp_path, *overrides):
    return run_config(
        f"paths.results_dir={tmp_path}/results",
        f"paths.data_dir={DATA_DIR}",
        "logger=wandb",
        *overrides,
    )


SENSITIVITY = ("eval=sensitivity", "eval.n_sequences=2", "eval.seqlen=64", "experiment_name=sens")


def only_run(wandb_dirs, job_type=None):
    runs = [r for r in offline_runs(wandb_dirs / "runs") if job_type in (None, r.job_type)]
    assert len(runs) == 1, [r.run_id for r in runs]
    return runs[0]


@needs_tiny
def test_a_sensitivity_run_holds_r_c_and_r_p_of_every_layer(wandb_dirs):
    from quantmla.run import run

    record = run(job(wandb_dirs, *SENSITIVITY))
    m = record["metrics"]
    logged = only_run(wandb_dirs)
    table = logged.table("sensitivity/per_layer")
    assert table["columns"] == ["layer", "R_C", "R_P"]
    assert [row[0] for row in table["data"]] == m["sensitivity/layers"]
    assert [row[1] for row in table["data"]] == pytest.approx(m["sensitivity/R_content"], rel=1e-12)
    assert [row[2] for row in table["data"]] == pytest.approx(m["sensitivity/R_rope"], rel=1e-12)
    by_layer = [row for row in logged.history if "per_layer/R_C" in row]  # W&B draws R vs layer
    assert [row["layer"] for row in by_layer] == m["sensitivity/layers"]
    assert [row["per_layer/R_P"] for row in by_layer] == pytest.approx(m["sensitivity/R_rope"])
    # the run config: sweep axes at top level, the job config beside
    assert (logged.config["model"], logged.config["precision"], logged.config["eval_kind"]) == (
        "tiny_mla", "c4r4", "sensitivity"
    )  # fmt: skip
    assert logged.config["job"]["eval"]["n_sequences"] == 2
    assert logged.group == "sens" and logged.summary["sensitivity/target_nmse"] == 0.01
    assert logged.summary["quantmla/not_logged"] == {}


@needs_tiny
def test_a_probes_run_holds_its_per_layer_gains(wandb_dirs):
    from quantmla.run import run

    overrides = ["eval=probes", "eval.n_sequences=1", "eval.seqlen=64", "eval.probes=4"]
    record = run(job(wandb_dirs, *overrides, "eval.interventions=1", "eval.probe_chunk=4"))
    m = record["metrics"]
    table = only_run(wandb_dirs).table("probes/per_layer")
    columns = table["columns"]
    for ours, paper in (
        ("G_content", "G_C"),
        ("G_rope", "G_P"),
        ("T_rope", "T_P"),
        ("A_content", "A_C"),
    ):
        values = [row[columns.index(paper)] for row in table["data"]]
        assert values == pytest.approx(m[f"probes/{ours}"], rel=1e-12)
    assert [row[0] for row in table["data"]] == m["probes/layers"]


@needs_tiny
def test_an_lm_eval_run_holds_lm_evals_results_table_and_samples(wandb_dirs):
    from quantmla.run import run

    record = run(job(wandb_dirs, "eval=table1_suite", "eval.tasks=[piqa]", "eval.limit=4"))
    logged = only_run(wandb_dirs)
    table = logged.table("evaluation/eval_results")  # lm-eval's WandbLogger, not ours
    assert table["columns"][0] == "Tasks"
    rows = {(row[0], row[table["columns"].index("Metric")]): row for row in table["data"]}
    value = float(rows[("piqa", "acc_norm")][table["columns"].index("Value")])
    assert 100 * value == pytest.approx(record["metrics"]["acc/piqa"])
    assert logged.summary["acc/piqa"] == pytest.approx(record["metrics"]["acc/piqa"])
    assert "piqa_eval_results" in logged.tables()  # the sample predictions
    assert "_lm_eval/results" not in record["metrics"]  # the store keeps only the metrics


@needs_tiny
def test_a_ruler_run_logs_its_samples_though_each_scores_one_length(wandb_dirs):
    """A RULER sample holds only its own length's metric: lm-eval's sample table (which reads
    every configured metric from every sample) gets the metrics all samples share, and the job
    that wrote its record does not fail at the mirror."""
    from quantmla.run import run

    overrides = ("eval=ruler", "eval.context_lengths=[512,1024]", "eval.limit=1")
    record = run(job(wandb_dirs, "model=tiny_mla", *overrides, "eval.max_gen_toks=4"))
    logged = only_run(wandb_dirs)
    assert logged.summary["ruler/s_niah_1/512"] == record["metrics"]["ruler/s_niah_1/512"]
    assert {"niah_single_1_eval_results", "niah_single_3_eval_results"} <= set(logged.tables())


@needs_tiny
def test_the_artifact_runs_hold_the_regenerated_table_the_figure_and_the_records(wandb_dirs):
    from quantmla.run import run

    run(job(wandb_dirs, *SENSITIVITY))
    for tool, name in (("tables", "table4"), ("figures", "fig2")):
        proc = subprocess.run(
            [sys.executable, "-m", f"analysis.{tool}", name, "--experiment", "sens",
             "--results", str(wandb_dirs / "results"), "--out", str(wandb_dirs / "out"), "--wandb"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    runs = [r for r in offline_runs(wandb_dirs / "runs") if r.job_type == "artifact"]
    assert len(runs) == 2 and {r.group for r in runs} == {"sens"}
    assert len({r.run_id for r in runs}) == 1  # one artifact run per experiment (synced together)
    (tables,) = [r for r in runs if r.tables()]
    (figures,) = [r for r in runs if r.images()]
    table = tables.table("table/sens_table4")  # the output name of table4 for this experiment
    markdown = (wandb_dirs / "out" / "sens_table4.md").read_text()
    assert table["columns"][:3] == ["model", "layers", "cells"]
    assert all(str(cell).strip("*") in markdown for cell in table["data"][0])
    (image,) = figures.images().values()
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [a for r in runs for a in r.artifacts if a.type == "results"]
    assert {e.path for e in records[0].manifest.contents} == {
        f"{p.parent.name}/result.json"
        for p in (wandb_dirs / "results" / "sens").glob("*/result.json")
    }
    assert records[0].digest == records[1].digest  # same records, same content: one version


def test_a_table_with_the_papers_numbers_gets_a_paper_column():
    rows = [
        ["model", "precision", "method", "PIQA"],
        ["deepseek_v2_lite", "C4R4", "QuantMLA", "**80.1** (paper 80.74)"],
        ["deepseek_v2_lite", "C4R4", "RTN", "79.0"],
    ]
    columns, data = split_paper_columns(rows)
    assert columns == ["model", "precision", "method", "PIQA", "PIQA (paper)"]
    assert data == [
        ["deepseek_v2_lite", "C4R4", "QuantMLA", "**80.1**", "80.74"],
        ["deepseek_v2_lite", "C4R4", "RTN", "79.0", None],
    ]


def test_every_list_of_a_record_reaches_a_table_and_the_rest_is_listed():
    record = {
        "config": {"eval": {"kind": "perplexity"}},
        "metrics": {
            "ppl/wikitext2": 12.5,
            "nmse/attn_layers": [0.1, 0.2],
            "nll_windows/wikitext2": [2.0, 3.0, 4.0],
            "method/report": {
                "best_heldout": [{"content": 1.0, "rope": 2.0}, {"content": 3.0, "rope": 4.0}],
                "history": [{"step": 0, "layer0/content": 1.0}],
                "seconds_fit": 3.0,
            },
            "lm_eval/version": "0.4",
            "skipped": None,
        },
    }
    out = layout(record)
    assert out.scalars == {"ppl/wikitext2": 12.5, "method/report/seconds_fit": 3.0}
    assert out.per_layer == (
        ["layer", "attn_nmse", "best_heldout/content", "best_heldout/rope"],
        [[0, 0.1, 1.0, 2.0], [1, 0.2, 3.0, 4.0]],
    )
    assert out.tables == {"nll_windows/wikitext2": (["value"], [[2.0], [3.0], [4.0]])}
    assert out.calibration == [{"step": 0, "layer0/content": 1.0}]
    assert out.text == {"lm_eval/version": "0.4"} and set(out.not_logged) == {"skipped"}


@needs_tiny
def test_a_rerun_multirun_adds_no_wandb_runs_and_its_jobs_share_a_sweep(wandb_dirs):
    import os

    command = [
        sys.executable, "-m", "quantmla.run", "-m", "precision=c4r4,c2r4",
        "eval=perplexity", "eval.max_windows=1", "eval.datasets=[wikitext2]", "eval.nmse_windows=0",
        "eval.compare_bf16=false", "experiment_name=sweep", "logger=wandb",
        f"paths.results_dir={wandb_dirs}/results", f"paths.data_dir={DATA_DIR}",
        f"hydra.sweep.dir={wandb_dirs}/multirun/first",
    ]  # fmt: skip
    env = {**os.environ}
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    runs = offline_runs(wandb_dirs / "runs")
    assert len(runs) == 2 and {r.group for r in runs} == {"sweep"}
    sweep_tags = {t for r in runs for t in r.tags if t.startswith("sweep:")}
    assert len(sweep_tags) == 1 and {r.config["sweep"] for r in runs} == {sweep_tags.pop()[6:]}
    assert sorted(r.config["precision"] for r in runs) == ["c2r4", "c4r4"]
    command[-1] = f"hydra.sweep.dir={wandb_dirs}/multirun/second"
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("exists: skipped") == 2
    assert len(offline_runs(wandb_dirs / "runs")) == 2


@needs_tiny
def test_the_preview_prints_one_wandb_line(wandb_dirs):
    proc = subprocess.run(
        [sys.executable, "-m", "quantmla.run", "eval.max_windows=1", "eval.nmse_windows=1",
         f"paths.results_dir={wandb_dirs}/results", f"paths.data_dir={DATA_DIR}"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "W&B" in line or "wandb" in line.lower()
    ]
    assert len(lines) == 1 and lines[0].startswith("[quantmla] W&B offline run"), lines
    (logged,) = offline_runs(wandb_dirs / "runs")
    assert json.loads(json.dumps(logged.config["job"]))["model"]["name"] == "tiny_mla"


def test_the_artifact_run_of_a_paper_table_holds_the_papers_column(wandb_dirs):
    """Table 1 from records of the paper's own model: the W&B table carries the paper's GSM8K
    numbers in a column beside ours (the same numbers `analysis/paper_numbers.yaml` states)."""
    from analysis.tables import LAYOUTS

    store = wandb_dirs / "results" / "table1"
    tasks = [c.metric for c in LAYOUTS["table1"].columns]
    for i, method in enumerate(("rtn", "smoothquant", "quarot", "quantmla")):
        record = {
            "experiment": "table1",
            "config": {
                "model": {"name": "deepseek_v2_lite"},
                "precision": {"name": "c4r4"},
                "method": {"name": method},
                "eval": {"kind": "lm_eval"},
            },
            "metrics": {t: 50.0 + i for t in tasks},
        }
        (store / f"h{i}").mkdir(parents=True)
        (store / f"h{i}" / "result.json").write_text(json.dumps(record))
    proc = subprocess.run(
        [sys.executable, "-m", "analysis.tables", "table1", "--results", str(wandb_dirs / "results"),
         "--out", str(wandb_dirs / "out" / "tables"), "--wandb"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (logged,) = offline_runs(wandb_dirs / "runs")
    assert logged.job_type == "artifact" and logged.group == "table1"
    table = logged.table("table/table1")
    paper = table["columns"].index("GSM8K (paper)")
    by_method = {row[2]: row[paper] for row in table["data"]}
    assert by_method == {
        "RTN": "16.98",
        "SmoothQuant†": "24.56",
        "QuaRot†": "30.71",
        "QuantMLA": "35.25",
    }
    assert table["columns"][paper - 1] == "GSM8K" and "(paper" not in str(table["data"])


def test_a_mixed_allocation_is_per_layer_and_its_candidate_lists_are_tables():
    record = {
        "config": {"eval": {"kind": "perplexity"}},
        "metrics": {
            "nmse/attn_layers": [0.1, 0.2],
            "allocation/precisions": ["c2r4", "c4r4"],
            "allocation/output_rope": [[0.1, 0.2], [0.3, 0.4]],  # layers × candidates
            "allocation/candidate_bytes": [100, 200],  # as long as the layers, but per format
        },
    }
    out = layout(record)
    assert out.per_layer == (
        ["layer", "attn_nmse", "precisions", "output_P/0", "output_P/1"],
        [[0, 0.1, "c2r4", 0.1, 0.2], [1, 0.2, "c4r4", 0.3, 0.4]],
    )
    assert list(out.tables) == ["allocation/candidate_bytes"]
