"""Structured-config schemas of the Hydra app (`conf/`), and validation before any heavy work."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

from quantmla.errors import ConfigError, DataNotFoundError, NotImplementedYet


@dataclass
class ModelConfig:
    name: str = "tiny_mla"
    path: str = "assets/tiny-mla"  # local checkpoint folder (relative to the repo) or hub id
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    device: str = "cpu"
    eval_seqlen: int = 512  # perplexity window length
    trust_remote_code: bool = False


@dataclass
class PrecisionConfig:
    name: str = "c4r4"  # 'bf16' or 'c<x>r<y>'
    sink: int = 4
    recent: int = 128
    group_size: int = 64


@dataclass
class CalibrationConfig:
    """Calibration data and optimisation (SmoothQuant†, QuantMLA). Paper: 128 + 32 WikiText-2 sequences."""

    dataset: str = "wikitext2"
    split: str = (
        "valid"  # WikiText-2 train is not available here: calibrate on valid, evaluate on test
    )
    n_calibration: int = 128
    n_heldout: int = 32
    seqlen: int | None = None  # None: model.eval_seqlen
    capture_batch_size: int = 4
    store_dir: str | None = None  # memory-map captured activations here (large models)
    alphas: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5, 0.75, 1.0])
    steps: int = 300
    batch_size: int = 4
    lr_rotation: float = 1e-3
    lr_scale: float = 1e-2
    select_every: int = 25


@dataclass
class MethodConfig:
    name: str = "rtn"  # rtn | smoothquant | quarot | quantmla
    calibration: CalibrationConfig | None = None
    artifact: str | None = None  # load this transform artifact instead of calibrating


@dataclass
class DataConfig:
    data_dir: str | None = None  # local data folder; None -> $QUANTMLA_DATA_DIR, else the hub


@dataclass
class EvalConfig:
    kind: str = "perplexity"  # see EVAL_KINDS; the paper's other artifacts name theirs
    tasks: list[str] = field(default_factory=list)  # benchmark tasks (lm_eval / ruler kinds)
    context_lengths: list[int] = field(default_factory=list)  # ruler, memory, latency kinds
    datasets: list[str] = field(default_factory=lambda: ["wikitext2", "c4"])
    splits: dict[str, str] = field(default_factory=lambda: {"wikitext2": "test", "c4": "eval"})
    max_windows: int | None = None  # cap on windows per dataset (None: all)
    batch_size: int = 4
    compare_bf16: bool = True  # also measure the unquantized model in the same job
    nmse_windows: int = (
        8  # windows of the first dataset for per-layer attention-output NMSE (0: off)
    )


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "quantmla"
    entity: str | None = None
    mode: str = "offline"  # offline | online | disabled


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    experiment_name: str = "default"
    seed: int = 0
    results_dir: str = "results"
    force: bool = False  # recompute even if a record with this config hash exists
    threads: int = 0  # torch threads (0: leave torch's default)


ConfigStore.instance().store(name="run_schema", node=RunConfig)

METHODS = ("rtn", "smoothquant", "quarot", "quantmla")
# Evaluation kinds; those not in IMPLEMENTED_KINDS stop before loading anything.
EVAL_KINDS = (
    "perplexity",
    "memory",
    "lm_eval",
    "ruler",
    "sensitivity",
    "probes",
    "latency",
    "throughput",
)
IMPLEMENTED_KINDS = ("perplexity", "memory")
DTYPES = ("float32", "bfloat16", "float16", "auto")
DATASETS = ("wikitext2", "c4")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def resolve_model_path(path: str) -> str:
    """Repo-relative local paths resolve against the repository; anything else is returned as is."""
    candidate = repo_root() / path
    return str(candidate) if not Path(path).is_absolute() and candidate.exists() else path


def validate(cfg: RunConfig) -> None:
    """Every check that needs no model: one-line errors naming the field, value and what is allowed."""
    from quantmla.data.sources import resolve_data_dir
    from quantmla.models.loading import config_from_dict
    from quantmla.simulator import CachePolicy

    policy = CachePolicy(
        cfg.precision.name, cfg.precision.sink, cfg.precision.recent, cfg.precision.group_size
    )
    if cfg.method.name not in METHODS:
        raise ConfigError("method.name", cfg.method.name, METHODS)
    if (
        cfg.method.name in ("smoothquant", "quantmla")
        and cfg.method.calibration is None
        and not cfg.method.artifact
    ):
        raise ConfigError(
            "method.calibration", None, "a calibration block (see conf/method/quantmla.yaml)"
        )
    if cfg.model.dtype not in DTYPES:
        raise ConfigError("model.dtype", cfg.model.dtype, DTYPES)
    if cfg.eval.kind not in EVAL_KINDS:
        raise ConfigError("eval.kind", cfg.eval.kind, EVAL_KINDS)
    if cfg.eval.kind not in IMPLEMENTED_KINDS:
        raise NotImplementedYet(
            f"eval.kind={cfg.eval.kind!r} is not implemented yet (config and table layout exist); "
            f"implemented: {', '.join(IMPLEMENTED_KINDS)}"
        )
    if cfg.logger.name not in ("wandb", "none"):
        raise ConfigError("logger.name", cfg.logger.name, ("wandb", "none"))
    for name in cfg.eval.datasets:
        if name not in DATASETS:
            raise ConfigError("eval.datasets", name, DATASETS)
    if cfg.eval.kind == "memory":
        return  # analytic: no model, no data
    resolve_data_dir(cfg.data.data_dir)
    path = resolve_model_path(cfg.model.path)
    local = Path(path)
    if local.is_absolute() or path.startswith("."):
        if not (local / "config.json").is_file():
            raise DataNotFoundError(
                f"model.path={cfg.model.path!r}: no config.json at {local}; set model.path to a checkpoint folder or hub id"
            )
        config = config_from_dict(json.loads((local / "config.json").read_text()))
        policy.check_dims(config.kv_lora_rank, config.qk_rope_head_dim)
