"""Results store, resumable sweeps, experiment configs and launchers."""

import itertools
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from quantmla.errors import DataNotFoundError, NotImplementedYet, QuantMLAError
from quantmla.evaluation.registry import EVALUATORS
from quantmla.job import resolve as validate
from quantmla.run import run
from quantmla.tracking import store
from tests.conftest import DATA_DIR, REPO, compose_run, needs_tiny

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def resolved(*overrides, hydra=False):
    return compose_run(*overrides, hydra=hydra)


def sweep_jobs(name: str) -> list[list[str]]:
    """The overrides of every job an experiment's sweep expands to (its sweeper params' product)."""
    params = resolved(f"experiment={name}", hydra=True).hydra.sweeper.params
    axes = [
        [f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()
    ]
    return [[f"experiment={name}", *job] for job in itertools.product(*axes)]


def as_dict(*overrides):
    return OmegaConf.to_container(resolved(*overrides), resolve=True)


def test_calibration_fields_added_later_are_hashed_only_off_their_default():
    """`rope_objective` at its default leaves a record's config (and hash) as it was before the
    field existed; off it, the record is another."""
    from quantmla.job import record_config

    default = record_config(as_dict("method=quantmla"))
    assert "rope_objective" not in default["method"]["calibration"]
    before = as_dict("method=quantmla")
    del before["method"]["calibration"]["rope_objective"]
    assert store.config_hash(default) == store.config_hash(record_config(before))
    output = record_config(as_dict("method=quantmla", "method.calibration.rope_objective=output"))
    assert output["method"]["calibration"]["rope_objective"] == "output"
    assert store.config_hash(output) != store.config_hash(default)
    assert record_config(as_dict())["method"].get("calibration") is None  # RTN: no block


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


def test_weights_fingerprint_tells_checkpoints_apart(tmp_path, monkeypatch):
    """Same bytes, same digest wherever they lie; one changed byte (whole-file hashing) or one
    changed sampled block (large files) changes it; a hub id has none."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
        (folder / "config.json").write_text("{}")
    assert store.weights_fingerprint(a) == store.weights_fingerprint(b)
    (b / "config.json").write_text('{"x": 1}')  # not a weight file
    assert store.weights_fingerprint(a) == store.weights_fingerprint(b)
    weights = bytearray((b / "model.safetensors").read_bytes())
    weights[12345] ^= 1
    (b / "model.safetensors").write_bytes(weights)
    assert store.weights_fingerprint(a) != store.weights_fingerprint(b)
    monkeypatch.setattr(store, "WHOLE_FILE_BYTES", 1024)  # the sampled path
    monkeypatch.setattr(store, "BLOCK", 512)
    before = store.weights_fingerprint(b)
    weights[-1] ^= 1  # the last block is always read
    (b / "model.safetensors").write_bytes(weights)
    assert store.weights_fingerprint(b) != before
    assert store.weights_fingerprint("deepseek-ai/DeepSeek-V2-Lite") is None


@needs_tiny
def test_a_retrained_checkpoint_under_the_same_path_is_a_new_job(tmp_path):
    """The record's hash covers the weights: the same job on changed weights is not skipped."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.conftest import TINY_MLA, run_config, tiny_job

    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY_MLA, ckpt)
    job = tiny_job(tmp_path / "results", f"model.path={ckpt}")
    first = run(run_config(*job))
    assert first["config"]["model"]["weights"] == store.weights_fingerprint(TINY_MLA)
    assert run(run_config(*job))["created"] == first["created"]  # skipped: same weights
    state = load_file(ckpt / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    second = run(run_config(*job))
    assert second["config_hash"] != first["config_hash"]
    assert second["metrics"]["ppl/wikitext2"] != first["metrics"]["ppl/wikitext2"]


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
def test_every_experiment_job_validates(name, tmp_path, monkeypatch):
    """Each job of each sweep composes and passes validation (a typo in a sweep fails here); a kind
    that is not implemented yet may only stop after every other check passed."""
    from quantmla.evaluation.lm_eval.suites import TASKS

    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")  # the opt-in is tested in test_lm_eval
    cfg = resolved(f"experiment={name}", hydra=True)
    assert cfg.experiment_name == name and cfg.hydra.mode.name == "MULTIRUN"
    jobs = sweep_jobs(name)
    assert jobs
    serve = f"paths.serve_python={sys.executable}"  # throughput jobs: any existing python
    for job in jobs:
        config = OmegaConf.to_object(resolved(*job, f"paths.results_dir={tmp_path}", serve))
        evaluator = EVALUATORS[config.eval.kind]
        built = config.model.build is None or (REPO / config.model.path / "config.json").is_file()
        hub_model = evaluator.needs_model and not config.model.path.startswith(("assets/", "./"))
        hub_tasks = config.eval.kind == "lm_eval" and any(
            TASKS[t].local is None for t in config.eval.tasks
        )
        if evaluator.implemented and evaluator.needs_model and not built:
            with pytest.raises(DataNotFoundError, match="not built yet.*make testbed-smol"):
                validate(config)
        elif evaluator.implemented and (hub_model or hub_tasks):  # the hub is offline here
            with pytest.raises(DataNotFoundError, match="hub.*offline"):
                validate(config)
        elif evaluator.implemented:
            validate(config)
        else:
            with pytest.raises(NotImplementedYet):
                validate(config)


def test_a_typo_in_a_sweep_fails():
    with pytest.raises(Exception, match="deepseek_v2_lit"):
        resolved("experiment=fig5a_memory", "model=deepseek_v2_lit")


TINY_OVERRIDES = {
    "tiny_fig2_sensitivity": ["eval.n_sequences=1", "eval.seqlen=64", "eval.layers=[0,5]"],
    "tiny_table5_probes": [
        "eval.seqlen=32",
        "eval.layers=[1]",
        "eval.probes=4",
        "eval.interventions=2",
    ],
    "tiny_table1": [
        "eval.max_windows=1",
        "eval.datasets=[wikitext2]",
        "eval.nmse_windows=1",
        "method.calibration.n_calibration=2",
        "method.calibration.n_heldout=1",
        "method.calibration.steps=2",
        "method.calibration.select_every=1",
        "method.calibration.batch_size=1",
    ],
    "tiny_fig5a_memory": [],
    "tiny_frontier": ["eval.max_windows=1", "eval.datasets=[wikitext2]", "eval.nmse_windows=1"],
}


@pytest.mark.slow
@needs_tiny
@pytest.mark.parametrize("name", sorted(TINY_OVERRIDES))
def test_implemented_tiny_experiments_run(name, tmp_path):
    """Every job of the runnable tiny experiments, at toy size, writes its record."""
    jobs = sweep_jobs(name)
    extra = [f"paths.results_dir={tmp_path}", "logger=none", *TINY_OVERRIDES[name]]
    written = 0
    for job in jobs:
        cfg = OmegaConf.to_object(resolved(*job, *[o for o in extra if "calibration" not in o]))
        if cfg.method.calibration is not None:
            cfg = OmegaConf.to_object(resolved(*job, *extra))
        written += run(cfg) is not None
    assert written == len(list(tmp_path.glob(f"{name}/*/result.json"))) > 0


def test_memory_job_reads_the_model_dims(tmp_path):
    records = {
        model: run(
            OmegaConf.to_object(
                resolved(
                    f"model={model}", "eval=memory", "logger=none", f"paths.results_dir={tmp_path}"
                )
            )
        )
        for model in ("tiny_mla", "deepseek_v2_lite")
    }
    tiny, v2 = (records[m]["metrics"] for m in ("tiny_mla", "deepseek_v2_lite"))
    assert (tiny["memory/d_c"], v2["memory/d_c"]) == (128, 512)
    assert v2["memory/page_bytes"] == 20_480 and tiny["memory/page_bytes"] == 64 * (64 + 32 + 16)
    assert records["tiny_mla"]["config_hash"] != records["deepseek_v2_lite"]["config_hash"]


@pytest.mark.parametrize("launcher", ["slurm_gpu", "slurm_8gpu", "joblib"])
def test_launchers_resolve(launcher):
    cfg = resolved(f"hydra/launcher={launcher}", "hydra.sweep.dir=/tmp/sweep", hydra=True)
    launcher_cfg = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert "_target_" in launcher_cfg
    if launcher.startswith("slurm"):
        assert launcher_cfg["gpus_per_node"] in (1, 8) and launcher_cfg[
            "submitit_folder"
        ].startswith("/tmp/sweep")


def test_throughput_without_a_serving_venv_stops_in_one_line(tmp_path):
    with pytest.raises(
        QuantMLAError, match="paths.serve_python=.*does not exist.*make serve-setup"
    ):
        validate(
            OmegaConf.to_object(
                resolved("eval=throughput", f"paths.serve_python={tmp_path}/none/python")
            )
        )


@pytest.mark.slow
@needs_tiny
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
