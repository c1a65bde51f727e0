"""What the table and figure builders share: the results store's default root, output names of
an artifact's twins, the per-cell label of a study record, paired differences, byte-deterministic
figure saving and the `--wandb` flag."""

from __future__ import annotations

from pathlib import Path

MODEL_ORDER = (
    "deepseek_v2_lite",
    "deepseek_v3_base",
    "deepseek_r1",
    "kimi_k2_instruct",
    "longcat_flash_lite",
    "glm_4_7_flash",
)
# Fixed metadata: matplotlib otherwise stamps the creation date (PDF) and its version (both).
DETERMINISTIC = {
    "pdf": {"CreationDate": None, "Producer": None, "Creator": None},
    "png": {"Software": None},
}


def default_results_dir() -> Path:
    """The results store of the default `paths` config (`paths.results_dir` under `paths.root`)."""
    from quantmla.config import PathsConfig
    from quantmla.paths import Paths

    return Paths.from_config(PathsConfig()).results_dir


def add_wandb_arguments(parser) -> None:
    """`--wandb`: also log the regenerated artifact to the experiment's W&B `artifact` run
    (`--project`/`--entity`: where, also for `tables --source wandb`)."""
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="log it to W&B (one artifact run per experiment, with the records; offline unless "
        "WANDB_MODE=online)",
    )
    parser.add_argument("--project", default="quantmla", help="W&B project")
    parser.add_argument("--entity", default=None, help="W&B entity")


def wandb_logger(args):
    """The logger settings of `--wandb` (conf/logger/wandb.yaml's fields)."""
    import os
    from types import SimpleNamespace

    mode = os.environ.get("WANDB_MODE", "offline")
    return SimpleNamespace(name="wandb", project=args.project, entity=args.entity, mode=mode)


def output_name(name: str, experiment: str, default: str) -> str:
    """`name` for the paper's experiment; its twin's name otherwise (tiny_fig2_sensitivity → tiny_fig6_…)."""
    if experiment == default:
        return name
    return experiment.replace(default, name) if default in experiment else f"{experiment}_{name}"


def cell(record: dict) -> str:
    """A study record's cell: dataset × seed."""
    c = record["config"]
    return f"{c['eval']['datasets'][0]}/seed{c['seed']}"


def method_variant(method: dict) -> str:
    """A method's row: its name, and the extension settings its calibration holds off the paper's
    defaults (`quantmla.config.CALIBRATION_HASH_NEUTRAL`: a record keeps them only then), so a
    variant gets a row of its own instead of merging into the paper's."""
    from quantmla.config import CALIBRATION_HASH_NEUTRAL

    calibration = method.get("calibration") or {}
    settings = [f"{k}={calibration[k]}" for k in CALIBRATION_HASH_NEUTRAL if k in calibration]
    return ", ".join([method["name"], *settings])


def mean_se(values) -> tuple[float, float]:
    """Mean and its standard error, sample std / √n."""
    import numpy as np

    d = np.asarray(values, float)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))


def paired_change(a, b) -> tuple[float, float]:
    """Mean of the per-item differences a − b (items scored by both records, in the same order)
    and its standard error."""
    import numpy as np

    return mean_se(np.asarray(a, float) - np.asarray(b, float))


def changed_documents(a: list | None, b: list | None):
    """Per document both cells scored (one list of scores per task, in the same order), True where
    the scores differ — a cache that keeps BF16's behaviour changes few documents, while the
    average can stay put with many changed both ways; None unless both have every task's scores."""
    import numpy as np

    if a is None or b is None or any(x is None or y is None for x, y in zip(a, b)):
        return None
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return None
    return np.concatenate([np.asarray(x) != np.asarray(y) for x, y in zip(a, b)])


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save(fig, out: Path, stem: str) -> list[Path]:
    """PNG + PDF without timestamps or version stamps (byte-identical when nothing changed)."""
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150, metadata=DETERMINISTIC[p.suffix[1:]])
    pyplot().close(fig)
    return paths
