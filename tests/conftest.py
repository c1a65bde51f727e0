import contextlib
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# registers the structured-config schemas for compose(); the serving venv (tests/serving) has no Hydra
with contextlib.suppress(ImportError):
    import quantmla.config  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QUANTMLA_SHARED", REPO.parent / "shared"))
DATA_DIR = SHARED / "data"
MODEL_CONFIGS = sorted(
    p for p in (SHARED / "model-configs").glob("*.json") if p.name != "sources.json"
)
TINY_MLA = REPO / "assets" / "tiny-mla"

torch.set_num_threads(2)
if (
    not torch.cuda.is_available()
):  # Triton kernels run in its CPU interpreter (before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests run only where CUDA is available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ctx():
    """A 2-layer random MLA model's calibration context: 4 calibration + 2 held-out sequences."""
    from transformers import AutoModelForCausalLM

    from quantmla.calibration.context import CalibrationContext
    from quantmla.models.adapters import get_adapter
    from quantmla.models.capture import capture_inputs
    from quantmla.models.tiny import tiny_mla_config

    torch.manual_seed(0)
    config = tiny_mla_config(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    sequences = torch.randint(0, 128, (6, 48), generator=torch.Generator().manual_seed(1))
    store = capture_inputs(model, modules, sequences, batch_size=3)
    return CalibrationContext(model, adapter, modules, store, torch.arange(4), torch.arange(4, 6))


@contextlib.contextmanager
def fit_stopped_at(monkeypatch, step: int):
    """A QuantMLA fit run inside stops after `step` (as a killed job would, its state saved)."""
    from quantmla.calibration.module import QuantMLACalibration

    original = QuantMLACalibration.on_train_batch_end

    def stopping(self, outputs, batch, batch_idx):
        original(self, outputs, batch, batch_idx)
        if self.global_step == step:
            raise RuntimeError("stopped (as a killed job would)")

    monkeypatch.setattr(QuantMLACalibration, "on_train_batch_end", stopping)
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            yield
    finally:
        monkeypatch.setattr(QuantMLACalibration, "on_train_batch_end", original)


def compose_run(*overrides, hydra: bool = False):
    """The composed app config (as `python -m quantmla.run` builds it) for `overrides`."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def run_config(*overrides):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(compose_run(*overrides))


def tiny_job(tmp_path, *overrides):
    """Overrides for the smallest real job on the tiny model: 1 WikiText-2 window, no W&B."""
    return [
        f"paths.results_dir={tmp_path}",
        f"paths.data_dir={DATA_DIR}",
        "eval=perplexity",
        "eval.max_windows=1",
        "eval.datasets=[wikitext2]",
        "eval.nmse_windows=0",
        "eval.compare_bf16=false",
        "logger=none",
        *overrides,
    ]


needs_tiny = pytest.mark.skipif(
    not (TINY_MLA / "config.json").is_file() or not DATA_DIR.is_dir(),
    reason="needs the tiny model and shared data",
)


@pytest.fixture
def data_dir():
    if not DATA_DIR.is_dir():
        pytest.skip(f"shared data not found at {DATA_DIR}")
    return DATA_DIR


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error; NaN anywhere fails comparisons."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
