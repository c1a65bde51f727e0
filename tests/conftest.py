import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import quantmla.config  # noqa: E402,F401  (registers the structured-config schemas for compose())

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QUANTMLA_SHARED", REPO.parent / "shared"))
DATA_DIR = SHARED / "data"
MODEL_CONFIGS = sorted(
    p for p in (SHARED / "model-configs").glob("*.json") if p.name != "sources.json"
)
TINY_MLA = REPO / "assets" / "tiny-mla"

torch.set_num_threads(2)


@pytest.fixture
def data_dir():
    if not DATA_DIR.is_dir():
        pytest.skip(f"shared data not found at {DATA_DIR}")
    return DATA_DIR


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error; NaN anywhere fails comparisons."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
