"""`prepare_method` returns a `MethodResult` (or None for RTN). For calibrated methods it hashes the
calibration token ids, looks for a saved artifact with matching metadata (model, precision,
quantizer, method, seed, calibration data, fit settings) and loads it; when there is none it takes
every unit (a layer's content or RoPE transform) an earlier artifact fitted (`reuse`) and only for
the others captures the BF16 teacher and calibrates. `apply_method` fuses the result. Calibration always sees the
unquantized, unfused model.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time

import torch

from quantmla.calibration.context import CalibrationContext
from quantmla.config import CALIBRATION_HASH_NEUTRAL, calibrated_rope_online, calibration_seqlen
from quantmla.data import calibration_split, load_text, tokenize
from quantmla.methods.base import (
    ArtifactMismatchError,
    MethodJob,
    artifact_path,
    load_artifact,
    retired_config_hashes,
    save_artifact,
)
from quantmla.methods.registry import METHODS
from quantmla.methods.reuse import MAGNITUDE, assemble, needed_units, reuse_report, saved_units
from quantmla.models.capture import capture_inputs
from quantmla.spec import QuantizerSpec
from quantmla.tracking.store import stable_hash


def tensor_sha(t: torch.Tensor) -> str:
    """16 hex digits of sha256 over the tensor's bytes: which token ids an artifact was made from."""
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


# config fields that name the checkout or the library, not the model
CHECKOUT_FIELDS = ("_name_or_path", "transformers_version")


def config_sha(config) -> str:
    """16 hex digits naming a model config whatever folder it was loaded from (an artifact keyed
    on the checkout's path was missed by every other clone of the repository)."""
    return stable_hash({k: v for k, v in config.to_dict().items() if k not in CHECKOUT_FIELDS}, 16)


def calibration_sequences(cfg, paths, tokenizer) -> tuple[torch.Tensor, int]:
    """(calibration + held-out token windows, number of calibration windows), seeded (docs/method.md §4)."""
    cal = cfg.method.calibration
    ids = tokenize(load_text(cal.dataset, cal.split, paths.data_dir), tokenizer)
    split = calibration_split(
        ids, cal.n_calibration, cal.n_heldout, calibration_seqlen(cfg), cfg.seed
    )
    return torch.cat([split.calibration, split.heldout]), split.calibration.shape[0]


# the calibration settings that shape a fit (the data's are in its hash; batching for capture is not)
FIT_SETTINGS = ("alphas", "steps", "batch_size", "lr_rotation", "lr_scale", "select_every")


def fit_settings(cal) -> dict:
    """The settings that shape a fit, as an artifact's metadata keeps them."""
    settings = {k: getattr(cal, k) for k in FIT_SETTINGS}
    later = CALIBRATION_HASH_NEUTRAL.items()
    settings |= {k: getattr(cal, k) for k, v in later if getattr(cal, k) != v}
    return settings


def artifact_metadata(
    cfg, model, specs: list[QuantizerSpec], data_hash: str, weights
) -> dict[str, str]:
    """What an artifact is valid for; a mixed allocation names every layer's spec."""
    uniform = len(set(specs)) == 1
    fixed_range = any(s.fixed_range("content") for s in specs)
    return {
        "model": cfg.model.path,
        "model_config_hash": config_sha(model.config),
        "weights": str(weights),
        "precision": specs[0].precision
        if uniform
        else "mixed:" + ",".join(s.precision for s in specs),
        "quantizer": specs[0].key if uniform else ",".join(s.key for s in specs),
        "method": cfg.method.name,
        "seed": str(cfg.seed),
        "calibration_data": data_hash,
        "calibration": json.dumps(
            fit_settings(cfg.method.calibration), sort_keys=True, default=list
        ),
        **(MAGNITUDE if fixed_range else {}),  # (others keep the keys they had before it)
    }


def prepare_method(
    cfg, paths, model, adapter, tokenizer, specs: list[QuantizerSpec], weights: str | None
):
    """The run's method result: None (RTN), fixed (QuaRot†) or loaded/calibrated (SmoothQuant†,
    QuantMLA), each layer at its own spec (`specs`, one per MLA layer); `weights` is the job's
    weights fingerprint (artifacts never outlive retraining)."""
    method = METHODS[cfg.method.name]
    modules = adapter.attention_modules(model)
    if not method.calibrated:
        return method.build(MethodJob(modules, specs, seed=cfg.seed))
    cal = cfg.method.calibration
    sequences, n_calibration = calibration_sequences(cfg, paths, tokenizer)
    expected = artifact_metadata(cfg, model, specs, tensor_sha(sequences), weights)
    retired = retired_config_hashes(paths.artifacts_dir)
    if cfg.method.artifact:  # given by the user: always loaded, never overwritten
        path = paths.resolve(cfg.method.artifact)
        if not path.is_file():
            raise ArtifactMismatchError(f"method.artifact={cfg.method.artifact!r} does not exist")
        print(f"[quantmla] loading {method.name} artifact {path}")
        return load_artifact(path, expected, retired)
    path = artifact_path(paths.artifacts_dir / method.name, expected, retired)
    if path.is_file():  # force=true recomputes the record, not a fit its metadata pins: delete it
        print(f"[quantmla] loading {method.name} artifact {path}")
        return load_artifact(path, expected, retired)
    units = saved_units(path.parent, expected, specs, retired) if cal.reuse_units else {}
    needed = needed_units(specs)
    if units:
        sources = ", ".join(f"{len(u)} from {f}" for f, u in reuse_report(units).items())
        print(f"[quantmla] {len(units)} of {len(needed)} units fitted before: {sources}")
    if units and units.keys() >= needed.keys():  # nothing to fit (not saved again)
        result = assemble(method.name, len(specs), units, calibrated_rope_online(cal))
        result.metadata = expected
        return result
    started = time.time()
    store = capture_inputs(model, modules, sequences, cal.capture_batch_size, cal.store_dir)
    captured = time.time() - started
    ctx = CalibrationContext(
        model,
        adapter,
        modules,
        store,
        torch.arange(n_calibration),
        torch.arange(n_calibration, sequences.shape[0]),
        keep_teacher=cal.keep_teacher_outputs,
    )
    job = MethodJob(
        modules, specs, cal, ctx, cfg.seed, log_dir=path.parent / "logs" / path.stem,
        resume_path=path.parent / "resume" / f"{path.stem}.ckpt", fixed=units,
    )  # fmt: skip
    result = method.build(job)
    # the captured inputs and kept teacher outputs (GBs: 11 on SmolLM2-MLA) go before the model is
    # evaluated; the fit's Lightning objects hold them in reference cycles, which only a
    # collection frees (a job that kept them ran out of memory beside a paused RULER job)
    del job, ctx, store
    gc.collect()
    if result.report is not None:  # where a calibration's time goes
        result.report["seconds_capture"] = captured
    result.metadata = expected
    save_artifact(result, path)
    print(f"[quantmla] saved {method.name} artifact {path}")
    return result
