"""Results store, resumable sweeps, experiment configs and launchers."""

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quantmla.tracking import store
from tests.conftest import DATA_DIR, REPO, TINY_MLA

CONF = str(REPO / "conf")
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def resolved(*overrides, hydra=False):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def as_dict(*overrides):
    return OmegaConf.to_container(resolved(*overrides), resolve=True)


def test_config_hash_stable_and_sensitive():
    base = store.config_hash(as_dict())
    assert base == store.config_hash(as_dict())
    assert store.config_hash(as_dict("precision=c2r4")) != base
    assert store.config_hash(as_dict("precision.recent=64")) != base
    assert store.config_hash(as_dict("method=quantmla")) != base
    assert store.config_hash(as_dict("seed=1")) != base
    # where things are written or read from, logging and re-run control do not change a result
    for same in (
        "paths.results_dir=/elsewhere",
        "paths.data_dir=/other/data",
        "logger=none",
        "force=true",
        "threads=2",
        "experiment_name=other",
    ):
        assert store.config_hash(as_dict(same)) == base, same


def test_atomic_write_leaves_no_partial_record(tmp_path, monkeypatch):
    path = tmp_path / "exp" / "abc" / "result.json"
    store.write_atomic(path, {"a": 1})
    real_dump = json.dump

    def crash(obj, f, **kw):
        f.write('{"half": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write_atomic(tmp_path / "exp" / "def" / "result.json", {"b": 2})
    monkeypatch.setattr(json, "dump", real_dump)
    assert json.loads(path.read_text()) == {"a": 1}
    assert not (tmp_path / "exp" / "def" / "result.json").exists()
    assert not list(tmp_path.rglob(".result-*"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = resolved(f"experiment={name}", hydra=True)
    assert cfg.experiment_name == name
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.hydra.sweeper.params
    OmegaConf.to_container(cfg, resolve=False)


@pytest.mark.parametrize("launcher", ["slurm_gpu", "slurm_8gpu", "joblib"])
def test_launchers_resolve(launcher):
    cfg = resolved(f"hydra/launcher={launcher}", "hydra.sweep.dir=/tmp/sweep", hydra=True)
    launcher_cfg = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert "_target_" in launcher_cfg
    if launcher.startswith("slurm"):
        assert launcher_cfg["gpus_per_node"] in (1, 8) and launcher_cfg[
            "submitit_folder"
        ].startswith("/tmp/sweep")


def test_not_implemented_artifacts_stop_cleanly():
    from quantmla.config import validate
    from quantmla.errors import NotImplementedYet

    with pytest.raises(NotImplementedYet, match="eval.kind='ruler' is not implemented yet"):
        validate(OmegaConf.to_object(resolved("eval=ruler")))


@pytest.mark.skipif(
    not (TINY_MLA / "config.json").is_file() or not DATA_DIR.is_dir(),
    reason="needs tiny model + data",
)
def test_interrupted_multirun_resumes_without_duplicates(tmp_path):
    common = [
        "eval.max_windows=1",
        "eval.nmse_windows=0",
        "eval.datasets=[wikitext2]",
        "eval.compare_bf16=false",
        "logger=none",
        f"paths.results_dir={tmp_path}",
        "experiment_name=resume",
        f"paths.data_dir={DATA_DIR}",
        f"hydra.sweep.dir={tmp_path}/multirun",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def multirun(*axes):
        subprocess.run(
            [sys.executable, "-m", "quantmla.run", "-m", *axes, *common],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
        )

    multirun("precision=c4r4", "method=rtn,quarot")  # the first 2 of 4 jobs, then "killed"
    first = {p: json.loads(p.read_text())["created"] for p in tmp_path.glob("resume/*/result.json")}
    assert len(first) == 2
    multirun("precision=c4r4,c8r8", "method=rtn,quarot")
    records = list(tmp_path.glob("resume/*/result.json"))
    assert len(records) == 4
    combos = {
        (r["config"]["precision"]["name"], r["config"]["method"]["name"])
        for r in map(lambda p: json.loads(p.read_text()), records)
    }
    assert combos == {("c4r4", "rtn"), ("c4r4", "quarot"), ("c8r8", "rtn"), ("c8r8", "quarot")}
    assert all(json.loads(p.read_text())["created"] == created for p, created in first.items())
