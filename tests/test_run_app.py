"""The Hydra app end to end on the tiny model: composes, evaluates, records, skips when done."""

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quantmla.run import run
from tests.conftest import DATA_DIR, REPO, TINY_MLA

CONF = str(REPO / "conf")


def compose_run(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize(
    "group,options",
    [
        (
            "model",
            [
                "tiny_mla",
                "deepseek_v2_lite",
                "moonlight_16b_a3b",
                "deepseek_v3_base",
                "deepseek_r1",
                "kimi_k2_instruct",
                "longcat_flash_lite",
                "glm_4_7_flash",
            ],
        ),
        ("precision", ["bf16", "c4r4", "c2r4", "c4r16", "c8r8"]),
    ],
)
def test_every_group_option_composes(group, options):
    for option in options:
        cfg = compose_run(f"{group}={option}")
        assert getattr(cfg, group).name == option


@pytest.mark.skipif(
    not (TINY_MLA / "config.json").is_file() or not DATA_DIR.is_dir(),
    reason="needs tiny model + data",
)
def test_default_run_writes_a_record_and_resumes(tmp_path, capsys):
    overrides = [f"paths.results_dir={tmp_path}", "eval.max_windows=2", f"paths.data_dir={DATA_DIR}"]
    record = run(compose_run(*overrides))
    path = next(tmp_path.glob("default/*/result.json"))
    stored = json.loads(path.read_text())
    assert stored == json.loads(json.dumps(record, default=str))
    assert {"config", "metrics", "git_sha", "versions", "created"} <= stored.keys()
    metrics = stored["metrics"]
    assert (
        metrics["ppl/wikitext2"] >= metrics["bf16/ppl/wikitext2"] * 0.999
        and metrics["windows/wikitext2"] == 2
    )
    assert "| c4r4 | rtn |" in capsys.readouterr().out
    again = run(compose_run(*overrides))  # same config: skipped, the record is returned unchanged
    assert again["created"] == stored["created"] and "skipped" in capsys.readouterr().out
