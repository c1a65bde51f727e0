"""What a new user hit on a fresh clone: each case stops in one line before heavy work, or works."""

import io
import shutil
import socket
import subprocess
import sys

import pytest

from quantmla.errors import CheckpointError, ConfigError, DataNotFoundError
from quantmla.job import resolve
from tests.conftest import DATA_DIR, REPO, TINY_MLA, needs_tiny, run_config


@pytest.mark.parametrize("kind", ["sensitivity", "probes"])
def test_study_at_an_unquantized_precision_is_one_line(kind, tmp_path):
    """Used to end in a 'zero error direction' traceback after loading the model."""
    with pytest.raises(ConfigError, match="precision='bf16'.*quantization error"):
        resolve(run_config(f"eval={kind}", "precision=bf16", f"paths.results_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="path C"):  # content unquantized, content path studied
        resolve(run_config(f"eval={kind}", "precision.name=c16r4", f"paths.results_dir={tmp_path}"))


def test_unwritable_artifacts_dir_stops_before_calibration(tmp_path):
    """Used to run capture + 16 min of calibration, then fail in Lightning's CSV logger."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="paths.artifacts_dir"):
        resolve(
            run_config(
                "method=quantmla",
                f"paths.results_dir={tmp_path}/results",
                f"paths.artifacts_dir={blocker}/artifacts",
            )
        )


def test_hub_without_network_is_offline_without_the_hf_variables(tmp_path, monkeypatch):
    """Offline but with no HF_*_OFFLINE set, a hub-only task used to load the model, retry the hub
    five times and fail after 137 s; now it stops in validation."""
    from quantmla import paths

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache

    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    paths.hub_offline.cache_clear()
    try:
        assert paths.hub_offline()
        with pytest.raises(DataNotFoundError, match="hub"):
            resolve(
                run_config(
                    "eval=table2_suite",
                    f"paths.data_dir={DATA_DIR}",
                    f"paths.results_dir={tmp_path}/results",
                )
            )
    finally:
        paths.hub_offline.cache_clear()


def _generate(*args, stdin: str | None = None, cwd=REPO):
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['quantmla.generate', *{list(args)!r}]\n"
        "try:\n    runpy.run_module('quantmla.generate', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "print('HEAVY', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, input=stdin
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["prompt="], "error: prompt='' is not allowed; allowed: some text to continue"),
        (["prompt=   "], "error: prompt='   ' is not allowed"),
        (["max_new_tokens=0"], "error: max_new_tokens=0 is not allowed; allowed: >= 1"),
        (["prompt_file=/nonexistent/p.txt"], "error: prompt_file='/nonexistent/p.txt'"),
    ],
)
def test_generate_bad_prompt_is_one_line_before_torch(args, expected, tmp_path):
    """`prompt=""` used to be a 92-line reshape traceback after loading the model."""
    proc = _generate(*args, f"hydra.run.dir={tmp_path}/out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[0].startswith(expected), proc.stderr
    assert lines[1:] == ["HEAVY False"]


@pytest.mark.parametrize(
    "text",
    ["Café au lait, s'il vous plaît", "a,b", 'say "hi"', "back\\slash\\", "x=1, y=2", "日本語"],
)
def test_any_prompt_text_survives_hydras_parser(text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from quantmla.generate import quote_prompt

    (arg,) = quote_prompt([f"prompt={text}"])
    (override,) = OverridesParser.create().parse_overrides([arg])
    assert override.value() == text
    assert quote_prompt(["prompt='already quoted'"]) == ["prompt='already quoted'"]


def test_prompt_from_a_file_or_standard_input(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from quantmla.generate import read_prompt

    file = tmp_path / "p.txt"
    file.write_text("Über, alles\nzweite Zeile")
    assert read_prompt(SimpleNamespace(prompt="x", prompt_file=str(file))) == file.read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin, with comma"))
    assert read_prompt(SimpleNamespace(prompt="x", prompt_file="-")) == "from stdin, with comma"


def test_cache_size_line_is_never_inverted():
    from quantmla.generate import size_line

    assert size_line(held=9_000, bf16=1_000).startswith(
        "9.00x the BF16 bytes: the fixed protection"
    )
    assert "raw and a dequantized copy" in size_line(held=4_000, bf16=1_000, backend="simulator")
    assert size_line(held=1_000, bf16=3_200) == "3.20x smaller than BF16"


@needs_tiny
def test_generate_with_a_non_ascii_comma_prompt_runs_and_writes_nothing_into_the_checkout(tmp_path):
    before = set(REPO.iterdir())
    proc = _generate(
        "prompt=Café au lait, s'il vous plaît",
        "max_new_tokens=2",
        f"paths.data_dir={DATA_DIR}",
        f"hydra.run.dir={tmp_path}/out",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Café au lait, s'il vous plaît" in proc.stdout
    assert set(REPO.iterdir()) == before  # no generate.log in the repository root


@needs_tiny
def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path):
    """Used to be a 25-line SafetensorError that did not name the file."""
    from quantmla.models.loading import load_pretrained

    ckpt = tmp_path / "ckpt"
    shutil.copytree(TINY_MLA, ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated or corrupt"):
        resolve(
            run_config(
                f"model.path={ckpt}",
                f"paths.data_dir={DATA_DIR}",
                f"paths.results_dir={tmp_path}/r",
            )
        )
    with pytest.raises(CheckpointError, match=str(weights)):
        load_pretrained(str(ckpt))
    weights.write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_pretrained(str(ckpt))
