"""experiments/smol_campaign.py: every job names configs that exist and compose (each sweep's first
value), so a campaign stopped at any job runs on from there."""

import pytest

from experiments.smol_campaign import JOBS, main
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


def test_job_numbers_out_of_range_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--only", str(len(JOBS) + 1)])
    assert f"a job number from 1 to {len(JOBS)}" in capsys.readouterr().err
