"""Structured-config schemas of the Hydra app (`conf/`), and validation before any heavy work.

Every field carries a one-line `help` (shown by `python -m quantmla.run --help`). This module
imports nothing heavy: `--help` and config errors answer in seconds.
"""

from __future__ import annotations

import tempfile
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path

from quantmla.errors import ConfigError, DataNotFoundError, NotImplementedYet


def opt(default=MISSING, help: str = "", factory=None):  # noqa: A002
    """A dataclass field with a one-line description."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    name: str = opt("tiny_mla", "short name used in tables and tags")
    path: str = opt(
        "assets/tiny-mla", "checkpoint folder (relative to paths.checkpoints_dir) or hub id"
    )
    config: str | None = opt(None, "published config.json used before/without loading weights")
    dtype: str = opt("float32", "float32 | bfloat16 | float16 | auto")
    device: str = opt("cpu", "cpu | cuda | cuda:N | auto (shard over all GPUs)")
    eval_seqlen: int = opt(512, "perplexity window length (tokens)")
    trust_remote_code: bool = opt(
        False, "run a checkpoint's own modeling code (only if you trust it)"
    )


@dataclass
class PrecisionConfig:
    name: str = opt("c4r4", "'bf16' or 'c<x>r<y>': content/RoPE bits, x, y in 1..8 or 16")
    sink: int = opt(4, "first tokens read unquantized (BF16 protection)")
    recent: int = opt(128, "most recent tokens read unquantized (BF16 protection)")
    group_size: int = opt(64, "quantization group along d_c and d_r")


@dataclass
class CacheConfig:
    backend: str = opt(
        "simulator", "simulator | packed (paged packed cache + kernels; same function)"
    )
    kernel: str = opt("auto", "packed backend kernels: auto | torch (reference) | triton")


@dataclass
class CalibrationConfig:
    """Calibration data and optimisation (SmoothQuant†, QuantMLA); the only place their defaults live."""

    dataset: str = opt("wikitext2", "calibration text")
    split: str = opt("valid", "WikiText-2 train is not available here: calibrate on valid")
    n_calibration: int = opt(128, "calibration sequences (paper: 128)")
    n_heldout: int = opt(32, "held-out sequences for α and checkpoint selection (paper: 32)")
    seqlen: int | None = opt(None, "calibration sequence length; null: model.eval_seqlen")
    capture_batch_size: int = opt(4, "sequences per teacher forward during capture")
    store_dir: str | None = opt(None, "memory-map captured activations here (large models)")
    alphas: list[float] = opt(
        help="initial-scale exponents searched per layer and path",
        factory=lambda: [0.125, 0.25, 0.5, 0.75, 1.0],
    )
    steps: int = opt(300, "QuantMLA optimisation steps")
    batch_size: int = opt(4, "sequences per step and per held-out batch")
    lr_rotation: float = opt(1e-3, "Adam learning rate of the Cayley parameters")
    lr_scale: float = opt(1e-2, "Adam learning rate of angles and log-scales")
    select_every: int = opt(25, "steps between held-out checkpoint selections")


@dataclass
class MethodConfig:
    name: str = opt("rtn", "rtn | smoothquant | quarot | quantmla")
    calibration: CalibrationConfig | None = opt(None, "calibration block (calibrated methods)")
    artifact: str | None = opt(None, "load this transform artifact instead of calibrating")


@dataclass
class PathsConfig:
    root: str | None = opt(None, "base of relative paths; null: the repository root (else cwd)")
    data_dir: str | None = opt(None, "local data folder; null: the hub ($QUANTMLA_DATA_DIR wins)")
    results_dir: str = opt(
        "results", "results store: <results_dir>/<experiment>/<hash>/result.json"
    )
    artifacts_dir: str | None = opt(None, "calibrated transforms; null: <results_dir>/artifacts")
    checkpoints_dir: str | None = opt(None, "base of a relative model.path; null: root")


@dataclass
class EvalConfig:
    kind: str = opt("perplexity", "evaluator (see quantmla.evaluation.registry)")
    tasks: list[str] = opt(help="benchmark tasks (lm_eval / ruler kinds)", factory=list)
    context_lengths: list[int] = opt(help="ruler, memory, latency kinds", factory=list)
    datasets: list[str] = opt(help="perplexity datasets", factory=lambda: ["wikitext2", "c4"])
    splits: dict[str, str] = opt(
        help="split per dataset", factory=lambda: {"wikitext2": "test", "c4": "eval"}
    )
    max_windows: int | None = opt(None, "windows per dataset (null: all = the full evaluation)")
    batch_size: int = opt(4, "windows per forward")
    compare_bf16: bool = opt(True, "also measure the unquantized model in the same job")
    nmse_windows: int = opt(8, "windows for per-layer attention-output NMSE (0: off)")
    # sensitivity / probes (one cell = one dataset in `datasets` × `seed`)
    paths: list[str] = opt(
        help="analysed cache paths: C (content), P (RoPE)", factory=lambda: ["C", "P"]
    )
    target_nmse: float = opt(
        0.01, "cache NMSE of the rescaled QDQ error (sensitivity 0.01, probes 1e-3)"
    )
    n_sequences: int = opt(8, "non-overlapping windows per cell")
    seqlen: int = opt(512, "tokens per window of a cell")
    layers: list[int] = opt(help="MLA layer indices to analyse (empty: all)", factory=list)
    probes: int = opt(256, "Rademacher probes per path (probes kind)")
    probe_chunk: int = opt(16, "probes per vmapped VJP batch (bounds memory)")
    interventions: int = opt(16, "draws per equal-energy intervention (probes kind)")
    # lm_eval / ruler
    limit: int | None = opt(
        None,
        "smoke/CPU knob: lm_eval: documents per task (lm-eval's --limit, per MMLU subject); "
        "ruler: samples per length (null: all / the paper's 500)",
    )
    data: str = opt(
        "local", "local: tasks with documents in paths.data_dir read them; hub: upstream"
    )
    max_gen_toks: int | None = opt(None, "generation budget for every generate task (null: task's)")
    apply_chat_template: bool = opt(False, "chat template (thinking disabled) for every prompt")
    haystacks: list[str] = opt(
        help="retrieval kind: noise (our filler) and/or c4 (C4 evaluation slice)", factory=list
    )


@dataclass
class LoggerConfig:
    name: str = opt("wandb", "wandb | none")
    project: str = opt("quantmla", "W&B project")
    entity: str | None = opt(None, "W&B entity")
    mode: str = opt("offline", "offline | online | disabled")


@dataclass
class RunConfig:
    model: ModelConfig = opt(help="the MLA model", factory=ModelConfig)
    precision: PrecisionConfig = opt(help="cache precision and protection", factory=PrecisionConfig)
    cache: CacheConfig = opt(
        help="which cache implementation generation runs on", factory=CacheConfig
    )
    method: MethodConfig = opt(help="quantization method", factory=MethodConfig)
    paths: PathsConfig = opt(
        help="data, results, artifacts, checkpoints roots", factory=PathsConfig
    )
    eval: EvalConfig = opt(help="what is measured", factory=EvalConfig)
    logger: LoggerConfig = opt(help="W&B mirror of the record", factory=LoggerConfig)
    experiment_name: str = opt("default", "results/<experiment_name>/...; W&B group")
    seed: int = opt(0, "seeds data sampling and calibration")
    force: bool = opt(False, "recompute even if a record with this config hash exists")
    threads: int = opt(0, "torch CPU threads (0: torch's default)")


@dataclass
class GenerateConfig(RunConfig):
    """`python -m quantmla.generate`: a run config plus the prompt."""

    prompt: str = opt("The history of", "text to continue (greedy)")
    max_new_tokens: int = opt(32, "tokens to generate")


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)


register_schemas()

DTYPES = ("float32", "bfloat16", "float16", "auto")
DATASETS = ("wikitext2", "c4")
LOGGERS = ("wandb", "none")


def describe(schema=RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted field, default, help) for every leaf field of a schema, for `--help`."""
    rows = []
    for f in fields(schema):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(default):
            rows += describe(type(default), f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("help", "")))
    return rows


def check_writable(path: Path, field_name: str) -> None:
    """Create `path` if needed and prove a file can be written in it (before any heavy work)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            field_name, str(path), f"a writable folder ({err.strerror or err})"
        ) from None


def validate(cfg: RunConfig):
    """Every check that needs no model: one-line errors naming the field, value and what is allowed.

    Returns the run's evaluator and resolved paths. An evaluator that is not implemented yet stops
    last, so a sweep's every other field is still checked."""
    from quantmla.evaluation.registry import EVALUATORS
    from quantmla.methods.registry import METHODS
    from quantmla.paths import Paths
    from quantmla.policy import CachePolicy

    policy = CachePolicy.from_config(cfg)
    method = METHODS.get(cfg.method.name)
    if method is None:
        raise ConfigError("method.name", cfg.method.name, tuple(METHODS))
    if method.calibrated and cfg.method.calibration is None and not cfg.method.artifact:
        raise ConfigError(
            "method.calibration", None, "a calibration block (see conf/method/quantmla.yaml)"
        )
    if cfg.model.dtype not in DTYPES:
        raise ConfigError("model.dtype", cfg.model.dtype, DTYPES)
    evaluator = EVALUATORS.get(cfg.eval.kind)
    if evaluator is None:
        raise ConfigError("eval.kind", cfg.eval.kind, tuple(EVALUATORS))
    if cfg.logger.name not in LOGGERS:
        raise ConfigError("logger.name", cfg.logger.name, LOGGERS)
    for name in cfg.eval.datasets:
        if name not in DATASETS:
            raise ConfigError("eval.datasets", name, DATASETS)
    if cfg.eval.max_windows is not None and cfg.eval.max_windows < 1:
        raise ConfigError("eval.max_windows", cfg.eval.max_windows, "null (all) or >= 1")
    paths = Paths.from_config(cfg.paths)
    check_writable(paths.results_dir, "paths.results_dir")
    if evaluator.needs_data:
        from quantmla.data.sources import resolve_data_dir

        resolve_data_dir(paths.data_dir)
    model_config = model_config_without_weights(cfg, paths)
    if evaluator.kind in ("lm_eval", "ruler"):
        from quantmla.data.sources import resolve_data_dir
        from quantmla.evaluation.suites import check_essays, check_lm_eval, data_mode

        data_dir = resolve_data_dir(paths.data_dir)
        check_lm_eval(cfg.eval, getattr(model_config, "max_position_embeddings", None), data_dir)
        if policy.backend == "packed" and cfg.eval.batch_size > 1:
            raise ConfigError(
                "eval.batch_size",
                cfg.eval.batch_size,
                "1 with cache.backend=packed (lm-eval left-pads batched prompts; the packed cache "
                "has no per-request start offset yet)",
            )
        if evaluator.kind == "ruler" and data_mode(cfg.eval, data_dir) == "local":
            check_essays(paths.data_dir)
    if evaluator.kind == "retrieval":
        from quantmla.evaluation.retrieval import check_config

        check_config(cfg.eval, getattr(model_config, "max_position_embeddings", None))
    if evaluator.kind in ("sensitivity", "probes"):
        from quantmla.evaluation.layer_study import check_study_config, mla_layer_count

        check_study_config(cfg, mla_layer_count(model_config) if model_config else None)
    if model_config is not None:
        policy.check_dims(model_config.kv_lora_rank, model_config.qk_rope_head_dim)
    elif not evaluator.needs_model:
        raise ConfigError(
            "model.config",
            None,
            f"a published config.json (eval.kind={evaluator.kind} reads only the config)",
        )
    if not evaluator.implemented:
        raise NotImplementedYet(
            f"eval.kind={cfg.eval.kind!r} is not implemented yet ({evaluator.description}); "
            f"implemented: {', '.join(k for k, e in EVALUATORS.items() if e.implemented)}"
        )
    if evaluator.needs_model:  # the environment, after every field
        check_checkpoint_reachable(cfg, paths)
    return evaluator, paths


def check_checkpoint_reachable(cfg: RunConfig, paths) -> None:
    """A hub id with the hub offline must already be in the local cache: else one line now,
    not a download error after the data is loaded."""
    import os

    from quantmla.paths import local_config_json

    if local_config_json(paths.checkpoint(cfg.model.path)) is not None:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"):
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(cfg.model.path, "config.json"), str):
        raise DataNotFoundError(
            f"model.path={cfg.model.path!r} is a hub id, the hub is offline (HF_HUB_OFFLINE) and it is "
            "not in the local cache; set model.path=<checkpoint folder> (e.g. in conf/local/default.yaml)"
        )


def model_config_without_weights(cfg: RunConfig, paths):
    """The model's published config fields (attribute access, no transformers import) from its local
    checkpoint's config.json, else from `model.config`, else None (a hub id: checked when it loads).
    A local path without config.json stops here."""
    import json
    from types import SimpleNamespace

    from quantmla.paths import local_config_json

    found = local_config_json(paths.checkpoint(cfg.model.path))
    if found is None and cfg.model.config:
        found = paths.resolve(cfg.model.config)
        if not found.is_file():
            raise DataNotFoundError(
                f"model.config={cfg.model.config!r}: no file at {found}; point it at a config.json or set it to null"
            )
    return SimpleNamespace(**json.loads(found.read_text())) if found is not None else None
