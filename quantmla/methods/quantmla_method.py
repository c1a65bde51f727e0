"""QuantMLA (docs/method.md §4): α-searched initial scales (the configured α list; conf/method/quantmla.yaml
includes α = 0, ties → smaller α), then one Lightning fit of every layer's content and RoPE
transforms, best held-out checkpoint per layer and path."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from quantmla.calibration.module import QuantMLACalibration
from quantmla.methods.base import MethodJob, MethodResult
from quantmla.methods.smoothquant import alpha_search


def quantmla(job: MethodJob) -> MethodResult:
    ctx, cal = job.context, job.calibration
    started = time.time()
    init, init_report = alpha_search(ctx, job.spec, cal.alphas, cal.batch_size)
    searched = time.time()
    L.seed_everything(job.seed, verbose=False)
    for p in ctx.model.parameters():
        p.requires_grad_(False)
    module = QuantMLACalibration(ctx, init, job.spec, cal)
    loader = torch.utils.data.DataLoader(
        ctx.calibration,
        batch_size=cal.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(job.seed),
    )
    device = ctx.device
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=cal.steps,
        # per-layer training and held-out losses as CSV (also mirrored to W&B by the run)
        logger=CSVLogger(job.log_dir.parent, name=job.log_dir.name) if job.log_dir else False,
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
