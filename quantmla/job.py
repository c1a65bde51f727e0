"""Validation resolves a job once: `resolve(cfg) -> Job` checks every field that needs no model (one
line naming the field, the value and what is allowed) and returns what every later stage reads —
the evaluator, the roots, the cache policy, the model's published config, the weights fingerprint,
the record's config and path — so `prepare` and the evaluators never re-derive them.

Each `eval.kind` reads only its own `eval.*` fields (`quantmla.evaluation.registry`): the job's
`cfg.eval` holds just those, and the record's config (so its hash) covers just those. Records made
before that rule hashed the whole `eval` block: `python -m quantmla.migrate` re-keys such a store.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from quantmla.config import DTYPES, FP8_MODES, LOGGERS, ROPE_OBJECTIVES, calibration_seqlen
from quantmla.errors import ConfigError, DataNotFoundError, NotImplementedYet
from quantmla.paths import Paths, hub_offline, local_config_json
from quantmla.policy import CachePolicy


@dataclass(frozen=True)
class Job:
    """One validated job. `cfg.eval` is narrowed to the kind's own fields (reading another raises)."""

    cfg: object  # RunConfig (or GenerateConfig)
    evaluator: object  # quantmla.evaluation.registry.Evaluator
    paths: Paths
    policy: CachePolicy
    model_config: SimpleNamespace | None  # published config fields; None for a hub id
    weights: str | None  # weights fingerprint of a local checkpoint (None for a hub id)
    config: dict  # the record's resolved config
    record_path: Path


def eval_fields(evaluator) -> tuple[str, ...]:
    return ("kind", *evaluator.fields)


def narrow_eval(config: dict) -> dict:
    """A resolved config dict with its `eval` block cut to the kind's own fields (the record form)."""
    from quantmla.evaluation.registry import EVALUATORS, HASH_NEUTRAL

    block = config["eval"]
    evaluator = EVALUATORS.get(block["kind"])
    if evaluator is None:
        raise ConfigError("eval.kind", block["kind"], tuple(EVALUATORS))
    kept = (k for k in eval_fields(evaluator) if k in block)
    return {
        **config,
        "eval": {k: block[k] for k in kept if k not in HASH_NEUTRAL or block[k] != HASH_NEUTRAL[k]},
    }


def narrow_precision(config: dict) -> dict:
    """A resolved config dict whose `precision` block keeps the mixed-only fields only when
    precision.name=mixed (every single-format record keeps its hash)."""
    from quantmla.config import MIXED_FIELDS, MIXED_HASH_NEUTRAL
    from quantmla.policy import MIXED

    block = config["precision"]
    if block.get("name") == MIXED:
        neutral = MIXED_HASH_NEUTRAL.items()
        return {**config, "precision": {k: v for k, v in block.items() if (k, v) not in neutral}}
    return {**config, "precision": {k: v for k, v in block.items() if k not in MIXED_FIELDS}}


def narrow_method(config: dict) -> dict:
    """A resolved config dict whose calibration block keeps the fields added later only off
    their default (every earlier record keeps its hash)."""
    from quantmla.config import CALIBRATION_HASH_NEUTRAL

    cal = config["method"].get("calibration")
    if not cal:
        return config
    neutral = CALIBRATION_HASH_NEUTRAL.items()
    kept = {k: v for k, v in cal.items() if (k, v) not in neutral}
    return {**config, "method": {**config["method"], "calibration": kept}}


def record_config(config: dict) -> dict:
    """A resolved config dict as its record keeps and hashes it."""
    return narrow_method(narrow_precision(narrow_eval(config)))


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


def resolve(cfg) -> Job:
    """Every check that needs no model, then the resolved job. An evaluator that is not implemented
    yet stops last, so a sweep's every other field is still checked."""
    from omegaconf import OmegaConf

    from quantmla.evaluation.registry import EVALUATORS
    from quantmla.methods.registry import METHODS
    from quantmla.tracking.store import record_path, weights_fingerprint

    policy = CachePolicy.from_config(cfg)
    method = METHODS.get(cfg.method.name)
    if method is None:
        raise ConfigError("method.name", cfg.method.name, tuple(METHODS))
    calibrates = method.calibrated and not cfg.method.artifact
    if calibrates and cfg.method.calibration is None:
        raise ConfigError(
            "method.calibration", None, "a calibration block (see conf/method/quantmla.yaml)"
        )
    if calibrates and cfg.method.calibration.rope_objective not in ROPE_OBJECTIVES:
        raise ConfigError(
            "method.calibration.rope_objective", cfg.method.calibration.rope_objective,
            ROPE_OBJECTIVES,
        )  # fmt: skip
    if calibrates and cfg.method.calibration.rope_positions:
        seqlen = calibration_seqlen(cfg)
        if cfg.method.calibration.rope_positions < seqlen:
            raise ConfigError(
                "method.calibration.rope_positions", cfg.method.calibration.rope_positions,
                f"0 (the captured positions) or at least the calibration seqlen ({seqlen})",
            )  # fmt: skip
    if cfg.model.dtype not in DTYPES:
        raise ConfigError("model.dtype", cfg.model.dtype, DTYPES)
    if cfg.model.fp8 not in FP8_MODES:
        raise ConfigError("model.fp8", cfg.model.fp8, FP8_MODES)
    evaluator = EVALUATORS.get(cfg.eval.kind)
    if evaluator is None:
        raise ConfigError("eval.kind", cfg.eval.kind, tuple(EVALUATORS))
    if cfg.logger.name not in LOGGERS:
        raise ConfigError("logger.name", cfg.logger.name, LOGGERS)
    paths = Paths.from_config(cfg.paths)
    check_writable(paths.results_dir, "paths.results_dir")
    if calibrates and evaluator.needs_model:
        check_writable(paths.artifacts_dir, "paths.artifacts_dir")
    if evaluator.needs_data:
        from quantmla.data.sources import resolve_data_dir

        resolve_data_dir(paths.data_dir)
    model_config = model_config_without_weights(cfg, paths)
    narrowed = replace(
        cfg, eval=SimpleNamespace(**{k: getattr(cfg.eval, k) for k in eval_fields(evaluator)})
    )
    partial = Job(narrowed, evaluator, paths, policy, model_config, None, {}, Path())
    if model_config is not None:
        policy.check_dims(model_config.kv_lora_rank, model_config.qk_rope_head_dim)
    if policy.mixed and not evaluator.mixed:
        raise ConfigError(
            "precision", "mixed", f"an eval.kind that runs one format per layer: "
            f"{', '.join(k for k, e in EVALUATORS.items() if e.mixed)} (not {evaluator.kind})",
        )  # fmt: skip
    evaluator.run_checks(narrowed, partial)
    if model_config is None and not evaluator.needs_model:
        raise ConfigError(
            "model.config",
            None,
            f"a published config.json (eval.kind={evaluator.kind} reads only the config)",
        )
    check_node(cfg, model_config)
    if not evaluator.implemented:
        raise NotImplementedYet(
            f"eval.kind={cfg.eval.kind!r} is not implemented yet ({evaluator.description}); "
            f"implemented: {', '.join(k for k, e in EVALUATORS.items() if e.implemented)}"
        )
    if evaluator.needs_model:  # the environment, after every field
        from quantmla.models.loading import check_checkpoint

        check_built(cfg, paths)
        check_checkpoint_reachable(cfg, paths)
        check_checkpoint(paths.checkpoint(cfg.model.path))
        check_fp8_native(cfg, model_config)
    config = record_config(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    weights = weights_fingerprint(paths.checkpoint(cfg.model.path))
    # the weights are part of the job: a retrained checkpoint under the same path is a new record
    config["model"]["weights"] = weights
    path = record_path(paths.results_dir, cfg.experiment_name, config)
    job = replace(partial, weights=weights, config=config, record_path=path)
    if policy.mixed:  # the candidates, the budget, the sensitivity records: before the model loads
        from quantmla.mixed import check

        check(job)
    return job


def check_node(cfg, model_config) -> None:
    """Under a SLURM launcher, the job's memory plan must fit one node (one line if not)."""
    from quantmla.planning import check_fits, current_launcher

    launcher = current_launcher()
    if launcher is None or launcher[1] is None or model_config is None:
        return
    check_fits(cfg, vars(model_config), *launcher)


def check_fp8_native(cfg, model_config) -> None:
    """FP8 weights kept as FP8 need CUDA's FP8 matmuls: one line on a machine without them."""
    from quantmla.models.sizes import is_fp8_checkpoint

    if (
        cfg.model.fp8 != "native"
        or model_config is None
        or not is_fp8_checkpoint(vars(model_config))
    ):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "model.fp8", "native", "dequantize on a machine without CUDA (FP8 matmuls need a GPU)"
        )


def not_built(cfg, paths: Paths) -> bool:
    """A testbed built locally (`model.build`) whose folder has no config.json yet."""
    build = getattr(cfg.model, "build", None)
    return bool(build) and not (paths.resolve(cfg.model.path) / "config.json").is_file()


def check_built(cfg, paths: Paths) -> None:
    """A testbed built locally that is not built yet: one line with its build command."""
    local = paths.resolve(cfg.model.path)
    if not_built(cfg, paths):
        raise DataNotFoundError(
            f"model.path={cfg.model.path!r}: not built yet ({local}); build it with `{cfg.model.build}`"
        )


def check_checkpoint_reachable(cfg, paths: Paths) -> None:
    """A hub id with the hub unreachable must already be in the local cache: else one line now,
    not a download error after the data is loaded."""
    if local_config_json(paths.checkpoint(cfg.model.path)) is not None or not hub_offline():
        return
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(cfg.model.path, "config.json"), str):
        raise DataNotFoundError(
            f"model.path={cfg.model.path!r} is a hub id, the hub is offline (unreachable) and it is not in "
            "the local cache; set model.path=<checkpoint folder> (e.g. in conf/local/default.yaml)"
        )


def model_config_without_weights(cfg, paths: Paths) -> SimpleNamespace | None:
    """The model's published config fields (attribute access, no transformers import) from its local
    checkpoint's config.json, else from `model.config`, else None (a hub id: checked when it loads).
    A local path without config.json stops here (naming the build command of a built testbed)."""
    if not_built(cfg, paths):
        if not cfg.model.config:
            check_built(cfg, paths)
        found = None  # not built yet: its committed config (the weights are checked later)
    else:
        found = local_config_json(paths.checkpoint(cfg.model.path))
    if found is None and cfg.model.config:
        found = paths.resolve(cfg.model.config)
        if not found.is_file():
            raise DataNotFoundError(
                f"model.config={cfg.model.config!r}: no file at {found}; point it at a config.json "
                "or set it to null"
            )
    return SimpleNamespace(**json.loads(found.read_text())) if found is not None else None
