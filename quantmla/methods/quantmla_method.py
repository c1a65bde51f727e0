"""QuantMLA (SPEC §4): α-searched initial scales (α = 0 included, ties → 0), then one Lightning fit
of every layer's content and RoPE transforms, best held-out checkpoint per layer and path."""

from __future__ import annotations

import time

import lightning as L
import torch

from quantmla.calibration.context import CalibrationContext
from quantmla.calibration.module import QuantMLACalibration
from quantmla.methods.base import MethodResult
from quantmla.methods.smoothquant import SMOOTHQUANT_ALPHAS, alpha_search
from quantmla.simulator import CachePrecision

QUANTMLA_ALPHAS = (0.0, *SMOOTHQUANT_ALPHAS)


def quantmla(
    ctx: CalibrationContext,
    bits: CachePrecision,
    steps: int = 300,
    batch_size: int = 4,
    lr_rotation: float = 1e-3,
    lr_scale: float = 1e-2,
    select_every: int = 25,
    group_size: int = 64,
    seed: int = 0,
    alphas=QUANTMLA_ALPHAS,
    logger=False,
) -> MethodResult:
    started = time.time()
    init, init_report = alpha_search(
        ctx, bits, alphas, group_size=group_size, batch_size=batch_size
    )
    searched = time.time()
    L.seed_everything(seed, verbose=False)
    for p in ctx.model.parameters():
        p.requires_grad_(False)
    module = QuantMLACalibration(
        ctx, init, bits, group_size, lr_rotation, lr_scale, batch_size, select_every
    )
    loader = torch.utils.data.DataLoader(
        ctx.calibration,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )
    device = ctx.device
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=steps,
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=10,
    )
    trainer.fit(module, loader)
    best = module.best_transforms()
    report = {
        "init": init_report,
        "best_step": [{p: b[p][2] for p in b} for b in module.best],
        "best_heldout": [{p: b[p][0] for p in b} for b in module.best],
        "history": module.history,
        "seconds_alpha_search": searched - started,
        "seconds_fit": time.time() - searched,
    }
    return MethodResult("quantmla", best, report=report)
