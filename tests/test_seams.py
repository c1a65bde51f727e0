"""The seams other work plugs into: registries, the prepare step, artifacts before capture, the
quantizer spec, patch-owned layer state, one NMSE."""

import subprocess
import sys

import pytest
import torch

from quantmla.evaluation.registry import EVALUATORS
from quantmla.memory import CacheLayout, layout
from quantmla.methods.registry import METHODS
from quantmla.metrics import RunningNMSE, nmse
from quantmla.run import run
from quantmla.spec import QuantizerSpec
from tests.conftest import REPO, needs_tiny, run_config, tiny_job

CALIBRATE_FAST = [
    "method=smoothquant",
    "method.calibration.n_calibration=2",
    "method.calibration.n_heldout=1",
    "method.calibration.alphas=[0.5]",
]


def test_registries_are_the_one_name_list():
    from analysis.tables import METHOD_LABEL, METHOD_ORDER

    assert METHOD_ORDER == tuple(METHODS) == ("rtn", "smoothquant", "quarot", "quantmla")
    assert METHOD_LABEL["quarot"] == "QuaRot†"
    names = {p.stem for p in (REPO / "conf" / "method").glob("*.yaml")}
    assert names == set(METHODS)
    from tests.conftest import run_config

    kinds = {
        run_config(f"eval={p.stem}").eval.kind for p in (REPO / "conf" / "eval").glob("*.yaml")
    }
    assert kinds <= set(EVALUATORS)


def test_quantizer_spec_key_and_memory_follow_the_metadata_dtypes():
    spec = QuantizerSpec.from_precision("c4r4")
    assert spec.key == "c4r4-asym-pertoken-g64-rne-content_bf16-rope_fp32"
    assert layout("c4r4").token_bytes() == 320
    fp32_meta = CacheLayout(QuantizerSpec(4, 4, content_meta_dtype="float32"))
    assert fp32_meta.metadata_bytes() == 8 * 5 + 5 + 3  # 45 B padded to 48
    assert QuantizerSpec(4, 16).key.startswith("c4r16-")


def test_nmse_is_one_definition():
    y = torch.randn(3, 5, dtype=torch.float64)
    y_hat = y + 0.1 * torch.randn_like(y)
    direct = float(((y_hat - y) ** 2).sum() / (y**2).sum())
    running = RunningNMSE()
    for a, b in zip(y_hat.split(1), y.split(1)):
        running.add(a, b)
    assert float(nmse(y_hat, y)) == pytest.approx(direct, rel=1e-12)
    assert running.value == pytest.approx(direct, rel=1e-12)
    assert float(nmse(torch.zeros(3), torch.zeros(3))) == 0.0  # zero reference: no NaN


def test_unpatch_leaves_no_state_behind():
    from transformers import AutoModelForCausalLM

    from quantmla.methods.base import MethodJob, apply_method
    from quantmla.methods.quarot import quarot
    from quantmla.models.adapters import get_adapter
    from quantmla.models.tiny import tiny_mla_config
    from quantmla.simulator import layer_patch, patch_model, unpatch_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_mla_config(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2)
    ).eval()
    modules = get_adapter(model.config).attention_modules(model)
    before = set(vars(modules[0])) | set(dict(modules[0].named_buffers()))
    patch_model(model, "c4r4")
    apply_method(model, get_adapter(model.config), quarot(MethodJob(modules, QuantizerSpec(4, 4))))
    assert layer_patch(modules[0]).rope_online is not None
    unpatch_model(model)
    after = set(vars(modules[0])) | set(dict(modules[0].named_buffers()))
    assert after == before


@needs_tiny
def test_an_artifact_keyed_on_the_checkouts_path_loads_once_its_hash_is_retired(
    tmp_path, monkeypatch, capsys
):
    """The older code hashed the loaded config with its path (`_name_or_path`): another checkout
    missed its artifacts. Written that way, an artifact is not found by today's key; after
    `python -m quantmla.migrate` verifies its hash against this checkout's checkpoint, it loads
    (no capture) from its own unchanged file, whole and as reused units."""
    import hashlib

    import quantmla.methods.prepare as prepare_module
    from quantmla.tracking.store import stable_hash

    with monkeypatch.context() as older:
        older.setattr(prepare_module, "config_sha", lambda c: stable_hash(c.to_dict(), 16))
        first = run(run_config(*tiny_job(tmp_path, *CALIBRATE_FAST)))
    [artifact] = (tmp_path / "artifacts" / "smoothquant").glob("*.safetensors")
    written = hashlib.sha256(artifact.read_bytes()).hexdigest()

    def no_capture(*args, **kwargs):
        raise AssertionError("captured activations although a matching artifact exists")

    monkeypatch.setattr(prepare_module, "capture_inputs", no_capture)
    again = (*CALIBRATE_FAST, "force=true")
    with pytest.raises(AssertionError, match="captured"):
        run(run_config(*tiny_job(tmp_path, *again)))

    def migrate():
        command = [sys.executable, "-m", "quantmla.migrate", str(tmp_path)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "1 retired, 0 current" in migrate()
    assert "0 retired, 1 current" in migrate()  # idempotent
    capsys.readouterr()
    loaded = run(run_config(*tiny_job(tmp_path, *again)))
    assert f"loading smoothquant artifact {artifact}" in capsys.readouterr().out
    assert loaded["metrics"]["ppl/wikitext2"] == pytest.approx(first["metrics"]["ppl/wikitext2"])
    # its content units alone, taken through reuse (nothing fitted, nothing saved)
    run(run_config(*tiny_job(tmp_path, *CALIBRATE_FAST, "precision=c4r16")))
    assert f"from {artifact.name}" in capsys.readouterr().out
    assert hashlib.sha256(artifact.read_bytes()).hexdigest() == written
    assert [artifact] == list(artifact.parent.glob("*.safetensors"))


def test_calibration_does_not_import_the_simulator():
    code = (
        "import sys, quantmla.calibration.module, quantmla.calibration.context;"
        "assert 'quantmla.simulator' not in sys.modules, 'calibration imports the simulator'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@needs_tiny
def test_matching_artifact_is_loaded_without_capture(tmp_path, monkeypatch, capsys):
    """Run 1 calibrates and saves; run 2 (another eval setting, same calibration) loads the artifact
    and never captures; force=true (recomputing the record) and method.artifact=<that file> load it
    too."""
    import quantmla.methods.prepare as prepare_module

    first = run(run_config(*tiny_job(tmp_path, *CALIBRATE_FAST)))
    artifact = next((tmp_path / "artifacts" / "smoothquant").glob("*.safetensors"))
    assert "saved smoothquant artifact" in capsys.readouterr().out

    def no_capture(*args, **kwargs):
        raise AssertionError("captured activations although a matching artifact exists")

    monkeypatch.setattr(prepare_module, "capture_inputs", no_capture)
    second = run(run_config(*tiny_job(tmp_path, *CALIBRATE_FAST, "eval.batch_size=2")))
    assert "loading smoothquant artifact" in capsys.readouterr().out
    assert second["metrics"]["ppl/wikitext2"] == pytest.approx(first["metrics"]["ppl/wikitext2"])
    third = run(
        run_config(
            *tiny_job(tmp_path, *CALIBRATE_FAST, "force=true", f"method.artifact={artifact}")
        )
    )
    assert third["metrics"]["ppl/wikitext2"] == pytest.approx(first["metrics"]["ppl/wikitext2"])
    again = run(run_config(*tiny_job(tmp_path, *CALIBRATE_FAST, "force=true")))  # the record only
    assert again["config_hash"] == first["config_hash"] and "loading smoothquant artifact" in (
        capsys.readouterr().out
    )
