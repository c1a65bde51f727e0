"""`python -m quantmla.export`: a fused checkpoint that reloads into exactly the job's function."""

import json

import pytest
from safetensors import safe_open

from quantmla.errors import ConfigError
from tests.conftest import DATA_DIR, REPO, needs_tiny, run_config

SMALL_CALIBRATION = [
    "method.calibration.n_calibration=8",
    "method.calibration.n_heldout=4",
    "method.calibration.seqlen=128",
]


def export_config(*overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return OmegaConf.to_object(compose("export", overrides=list(overrides)))


@needs_tiny
def test_export_reloads_to_the_jobs_numbers(tmp_path):
    from quantmla import patch_model
    from quantmla.checkpoint import load_manifest
    from quantmla.data import load_text, perplexity_windows, tokenize
    from quantmla.evaluation.perplexity import perplexity
    from quantmla.export import export
    from quantmla.models.loading import load_pretrained
    from quantmla.run import run

    common = [
        "method=smoothquant",
        *SMALL_CALIBRATION,
        f"paths.data_dir={DATA_DIR}",
        f"paths.results_dir={tmp_path}/results",
    ]
    job = [
        "eval=perplexity",
        "eval.max_windows=2",
        "eval.datasets=[wikitext2]",
        "eval.nmse_windows=0",
        "eval.compare_bf16=false",
        "logger=none",
    ]
    record = run(run_config(*common, *job))
    out = export(export_config(*common, f"out={tmp_path}/export"))
    manifest = load_manifest(out)
    assert manifest["precision"] == "c4r4" and manifest["method"] == "smoothquant"
    assert manifest["protection"] == {"sink": 4, "recent": 128}
    assert manifest["source"]["weights"] == record["config"]["model"]["weights"]
    assert manifest["equivalence"]  # the fused model passed the check before it was written
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" in names

    model, tokenizer = load_pretrained(str(out))
    q = manifest["quantizer"]
    patch_model(
        model,
        manifest["precision"],
        group_size=q["group_size"],
        **manifest["protection"],
    )
    ids = tokenize(load_text("wikitext2", "test", DATA_DIR), tokenizer)
    windows = perplexity_windows(ids, 512, 2)
    assert perplexity(model, windows) == record["metrics"]["ppl/wikitext2"]


def test_export_refuses_online_transforms_and_a_used_folder(tmp_path):
    from quantmla.export import check_out

    with pytest.raises(ConfigError, match="method.name='quarot'.*online"):
        check_out(export_config("method=quarot", f"out={tmp_path}/x"))
    with pytest.raises(ConfigError, match="rope_hadamard=True.*online"):
        check_out(export_config("method=quantmla", "method.calibration.rope_hadamard=true",
                                f"out={tmp_path}/x"))  # fmt: skip
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="out=.*new or empty folder"):
        check_out(export_config(f"out={used}"))
    with pytest.raises(ConfigError, match="out=None"):
        check_out(export_config())
    check_out(export_config(f"out={used}", "overwrite=true"))


def test_a_folder_without_manifest_is_one_line(tmp_path):
    from quantmla.checkpoint import load_manifest
    from quantmla.errors import DataNotFoundError

    with pytest.raises(DataNotFoundError, match="no quantmla.json"):
        load_manifest(tmp_path)
