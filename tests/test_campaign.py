"""experiments/smol_campaign.py: every job names configs that exist and compose (each sweep's first
value), so a campaign stopped at any job runs on from there."""

import subprocess

import pytest

from experiments.smol_campaign import JOBS, commit_results, main
from tests.conftest import REPO, run_config


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_each_job_composes_at_its_first_sweep_value(job):
    from quantmla.cli import route_precision
    from quantmla.job import resolve

    first = route_precision([o if "=[" in o else o.split(",")[0] for o in job.overrides])
    tiny = any(o.startswith("experiment=tiny_") for o in first)  # the sweep's model, as it runs
    cfg = run_config(*first, f"model={'tiny_mla_v2' if tiny else 'smol_mla'}", "logger=none")
    assert cfg.experiment_name.startswith("tiny_" if tiny else "smol_")
    # resolving reads a mixed job's sensitivity records, a vLLM job's serving venv and the built
    # checkpoint (SmolLM2-MLA: `make testbed-smol`, not built in CI)
    built = (REPO / cfg.model.path / "config.json").is_file()
    if (
        built
        and "precision=mixed" not in job.overrides
        and getattr(cfg.eval, "engine", None) != "vllm"
    ):
        resolve(cfg)


def test_each_job_with_several_values_composes_as_a_sweep():
    """Hydra runs an experiment's `hydra.mode: MULTIRUN` only when the job composes in that mode
    (`Hydra.get_mode`); otherwise a value list is refused as ambiguous when the job starts (e.g.
    `method=quantmla,rtn` beside `method.calibration.*`, which RTN's config does not have)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    import quantmla.config  # noqa: F401  (registers the schemas the configs name)
    from quantmla.cli import route_precision

    swept = [j for j in JOBS if any("," in o and "=[" not in o for o in j.overrides)]
    assert swept
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        hydra = GlobalHydra.instance().hydra
        for job in swept:
            mode = hydra.get_mode(
                config_name="config", overrides=route_precision(list(job.overrides))
            )
            assert mode == RunMode.MULTIRUN, job.name


def test_job_numbers_out_of_range_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--only", str(len(JOBS) + 1)])
    assert f"a job number from 1 to {len(JOBS)}" in capsys.readouterr().err


def test_job_lists_are_refused_by_the_number_out_of_range(capsys):
    with pytest.raises(SystemExit):
        main(["--only", f"2,{len(JOBS) + 1}", "--list"])
    assert f"--only {len(JOBS) + 1}: a job number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--only", "2,x"])
    assert "job numbers, e.g. 3 or 7,8,22" in capsys.readouterr().err


def test_commit_results_commits_the_results_store_and_nothing_else(tmp_path):
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True
        ).stdout

    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py"), git("commit", "-q", "-m", "start")
    assert not commit_results(tmp_path, "nothing")  # no results: no commit
    (tmp_path / "results" / "e" / "h").mkdir(parents=True)
    (tmp_path / "results" / "e" / "h" / "result.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 2\n")
    git("add", "code.py")  # staged work in progress stays out of the campaign's commit
    assert commit_results(tmp_path, "job 1: records")
    assert git("show", "--name-only", "--format=%s", "HEAD").split() == [
        "job", "1:", "records", "results/e/h/result.json",
    ]  # fmt: skip
    assert git("diff", "--cached", "--name-only").split() == ["code.py"]
