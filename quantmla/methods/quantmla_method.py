"""QuantMLA (docs/method.md §4): α-searched initial scales (the configured α list; conf/method/quantmla.yaml
includes α = 0, ties → smaller α), then one Lightning fit of every layer's content and RoPE
transforms, best held-out checkpoint per layer and path. With `job.resume_path` the fit saves its
state at every selection and a stopped fit resumes there, on the same batches (`step_batches`),
without searching α again (the search's report is saved with the state)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from quantmla.calibration.module import QuantMLACalibration
from quantmla.config import calibrated_rope_online
from quantmla.methods.base import MethodJob, MethodResult
from quantmla.methods.reuse import reuse_report
from quantmla.methods.smoothquant import alpha_search
from quantmla.transforms import LayerTransforms


def step_batches(indices: torch.Tensor, batch_size: int, steps: int, seed: int) -> list:
    """The calibration batch of every step: what `DataLoader(indices, batch_size, shuffle=True,
    drop_last=True, generator=Generator().manual_seed(seed))` yields epoch after epoch (from that
    generator each epoch's iterator draws a base seed, its sampler a permutation, then, once
    exhausted, the empty tail of a second one)."""
    generator = torch.Generator().manual_seed(seed)
    n, batches = len(indices), []
    while len(batches) < steps:
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        order = torch.randperm(n, generator=generator)
        torch.randperm(n, generator=generator)  # RandomSampler's tail: num_samples % n = 0 of it
        batches += [
            indices[order[i : i + batch_size]] for i in range(0, n - batch_size + 1, batch_size)
        ]
    return batches[:steps]


class _Batches(torch.utils.data.IterableDataset):
    """The remaining steps' batches, without a length: a resumed fit's epoch count is then not
    confused with the steps already run (a sized loader would end the restored epoch early)."""

    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class _SaveAtSelection(L.Callback):
    """The fit's state at every held-out selection, written atomically to `path`."""

    def __init__(self, path: Path, every: int):
        self.path, self.every = path, every

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0 and trainer.global_step < trainer.max_steps:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            trainer.save_checkpoint(partial, weights_only=False)
            os.replace(partial, self.path)


def quantmla(job: MethodJob) -> MethodResult:
    ctx, cal = job.context, job.calibration
    started = time.time()
    resume = job.resume_path if job.resume_path and job.resume_path.is_file() else None
    saved = torch.load(resume, weights_only=True) if resume else None
    init_report = saved["quantmla"].get("init") if saved else None
    if init_report is None:
        init, init_report = alpha_search(
            ctx, job.spec, cal.alphas, cal.batch_size, skip=job.fixed.keys(),
            rope_online=calibrated_rope_online(cal),
        )  # fmt: skip
    else:  # a resumed fit's parameters come from its state; the α search's outcome from its report
        init = [LayerTransforms() for _ in ctx.modules]
    searched = time.time()
    L.seed_everything(job.seed, verbose=False)
    for p in ctx.model.parameters():
        p.requires_grad_(False)
    module = QuantMLACalibration(
        ctx, init, job.spec, cal, init_report=init_report, fixed=job.fixed, seed=job.seed
    )
    start = saved["global_step"] if saved else 0
    del saved
    if resume:
        print(f"[quantmla] resuming the calibration at step {start} of {cal.steps} ({resume})")
    batches = step_batches(ctx.calibration, cal.batch_size, cal.steps, job.seed)
    loader = torch.utils.data.DataLoader(_Batches(batches[start:]), batch_size=None)
    saving = [_SaveAtSelection(job.resume_path, cal.select_every)] if job.resume_path else []
    device = ctx.device
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_steps=cal.steps,
        # per-layer training and held-out losses as CSV (also mirrored to W&B by the run)
        logger=CSVLogger(job.log_dir.parent, name=job.log_dir.name) if job.log_dir else False,
        enable_checkpointing=False,
        # tqdm, not Rich (Lightning's default where rich is installed): Rich draws nothing into a
        # log file, so a 1-2 hour fit showed no progress there
        callbacks=[*saving, TQDMProgressBar(refresh_rate=10)],
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=10,
    )
    trainer.fit(module, loader, ckpt_path=resume, weights_only=True)
    if job.resume_path is not None:
        job.resume_path.unlink(missing_ok=True)
    best = module.best_transforms()
    report = {
        "init": init_report,
        "best_step": [{p: b[p][2] for p in b} for b in module.best],
        "best_heldout": [{p: b[p][0] for p in b} for b in module.best],
        "history": module.history,
        "seconds_alpha_search": searched - started,
        "seconds_fit": time.time() - searched,
        "seconds_selection": module.seconds_selection,  # of seconds_fit (this process's part)
        "resumed_at_step": start,
    }
    if job.fixed:
        report["reused"] = reuse_report(job.fixed)
    return MethodResult("quantmla", best, calibrated_rope_online(cal), report=report)
