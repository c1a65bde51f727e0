"""The four methods on one quantizer: RTN, SmoothQuant†, QuaRot†, QuantMLA.

`prepare_method` returns a `MethodResult` (or None for RTN), loading a saved artifact when one
matches the run (model, precision, quantizer, method, seed, calibration data) and calibrating
otherwise; `apply_method` fuses it. Calibration always sees the unquantized, unfused model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger

from quantmla.calibration.capture import capture_inputs
from quantmla.calibration.context import CalibrationContext
from quantmla.data import calibration_split, load_text, tokenize
from quantmla.methods.base import (
    ArtifactMismatchError,
    MethodResult,
    apply_method,
    load_artifact,
    save_artifact,
)
from quantmla.methods.quantmla_method import quantmla
from quantmla.methods.quarot import quarot
from quantmla.methods.smoothquant import smoothquant
from quantmla.simulator import parse_precision
from quantmla.tracking.store import stable_hash

METHODS = ("rtn", "smoothquant", "quarot", "quantmla")
CALIBRATED = ("smoothquant", "quantmla")

__all__ = ["METHODS", "ArtifactMismatchError", "MethodResult", "apply_method", "prepare_method"]


def _tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def calibration_context(cfg, model, adapter, tokenizer) -> CalibrationContext:
    cal = cfg.method.calibration
    ids = tokenize(load_text(cal.dataset, cal.split, cfg.data.data_dir), tokenizer)
    split = calibration_split(
        ids, cal.n_calibration, cal.n_heldout, cal.seqlen or cfg.model.eval_seqlen, cfg.seed
    )
    sequences = torch.cat([split.calibration, split.heldout])
    modules = adapter.attention_modules(model)
    store = capture_inputs(model, modules, sequences, cal.capture_batch_size, cal.store_dir)
    n = split.calibration.shape[0]
    ctx = CalibrationContext(
        model, adapter, modules, store, torch.arange(n), torch.arange(n, sequences.shape[0])
    )
    ctx.data_hash = _tensor_sha(sequences)
    return ctx


def artifact_metadata(cfg, model, data_hash: str) -> dict[str, str]:
    p = cfg.precision
    return {
        "model": cfg.model.path,
        "model_config_hash": stable_hash(model.config.to_dict(), 16),
        "precision": p.name,
        "quantizer": f"asym-pertoken-g{p.group_size}-rne-content_bf16-rope_fp32",
        "method": cfg.method.name,
        "seed": str(cfg.seed),
        "calibration_data": data_hash,
    }


def prepare_method(cfg, model, adapter, tokenizer) -> MethodResult | None:
    """The run's method result: None (RTN), fixed (QuaRot†) or calibrated/loaded (SmoothQuant†, QuantMLA)."""
    name = cfg.method.name
    if name == "rtn":
        return None
    modules = adapter.attention_modules(model)
    if name == "quarot":
        return quarot(modules)
    cal = cfg.method.calibration
    bits = parse_precision(cfg.precision.name)
    ctx = calibration_context(cfg, model, adapter, tokenizer)
    expected = artifact_metadata(cfg, model, ctx.data_hash)
    path = Path(
        cfg.method.artifact
        or Path(cfg.results_dir) / "artifacts" / name / f"{stable_hash(expected, 16)}.safetensors"
    )
    if path.is_file() and not cfg.force:
        print(f"[quantmla] loading {name} artifact {path}")
        return load_artifact(path, expected)
    if cfg.method.artifact:
        raise ArtifactMismatchError(f"method.artifact={cfg.method.artifact!r} does not exist")
    group = cfg.precision.group_size
    if name == "smoothquant":
        result = smoothquant(
            ctx, bits, alphas=tuple(cal.alphas), group_size=group, batch_size=cal.batch_size
        )
    else:
        result = quantmla(
            ctx,
            bits,
            steps=cal.steps,
            batch_size=cal.batch_size,
            lr_rotation=cal.lr_rotation,
            lr_scale=cal.lr_scale,
            select_every=cal.select_every,
            group_size=group,
            seed=cfg.seed,
            alphas=tuple(cal.alphas),
            # per-layer training and held-out losses, beside the artifact (also mirrored to W&B)
            logger=CSVLogger(path.parent / "logs", name=path.stem),
        )
    result.metadata = expected
    save_artifact(result, path)
    print(f"[quantmla] saved {name} artifact {path}")
    return result
