"""Train the project's tiny MLA testbed (tokenizer + DeepSeek-V3-architecture model) on CPU.

    python -m experiments.train_tiny_mla                 # full run, writes assets/tiny-mla/
    python -m experiments.train_tiny_mla max_steps=20 out_dir=/tmp/tiny   # smoke run

Training text: the C4 sample *minus* its held-out evaluation slice, plus GSM8K train. Never
WikiText and never an evaluation split. A slice of the training stream is held out for the
held-out loss.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.config_store import ConfigStore
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf

from experiments.training import TinyModelConfig, adamw, training_documents, warmup_cosine
from quantmla.data import document_stream
from quantmla.models.tiny import tiny_mla_config, train_tokenizer


@dataclass
class TrainTinyConfig:
    data_dir: str | None = None  # local data folder; None -> $QUANTMLA_DATA_DIR or the hub
    out_dir: str = "assets/tiny-mla"
    vocab_size: int = 4096
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    seq_len: int = 512
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    max_steps: int = 700
    max_minutes: float = 55.0  # hard wall-clock stop (the schedule assumes max_steps)
    heldout_fraction: float = 0.02
    val_every: int = 175
    seed: int = 0
    threads: int = 2
    save_dtype: str = "bfloat16"


ConfigStore.instance().store(name="train_tiny_mla_schema", node=TrainTinyConfig)


class TinyLM(L.LightningModule):
    """Causal-LM training of a transformers model; AdamW with linear warm-up and cosine decay."""

    def __init__(self, model, cfg: TrainTinyConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.last_train_loss = float("nan")

    def training_step(self, batch, _):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=True)
        self.last_train_loss = float(loss.detach())
        return loss

    def validation_step(self, batch, _):
        self.log("heldout/loss", self.model(input_ids=batch, labels=batch).loss, prog_bar=True)

    def configure_optimizers(self):
        cfg = self.cfg
        opt = adamw(self.model, cfg.lr, cfg.weight_decay)

        def schedule(step: int) -> float:
            return warmup_cosine(step, 1.0, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def token_windows(docs: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Documents joined with EOS, cut into non-overlapping (N, seq_len) windows."""
    ids = document_stream(docs, tokenizer)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def train(cfg: TrainTinyConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    L.seed_everything(cfg.seed, workers=True)
    from transformers import AutoModelForCausalLM

    started = time.time()
    docs = training_documents(cfg.data_dir)
    tokenizer = train_tokenizer(docs, cfg.vocab_size)
    windows = token_windows(docs, tokenizer, cfg.seq_len)
    perm = torch.randperm(len(windows), generator=torch.Generator().manual_seed(cfg.seed))
    n_held = max(1, int(len(windows) * cfg.heldout_fraction))
    heldout, train_windows = windows[perm[:n_held]], windows[perm[n_held:]]
    print(
        f"tokenizer vocab {len(tokenizer)}; {windows.numel():,} tokens; {len(train_windows)} train / {n_held} held-out windows"
    )

    config = tiny_mla_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **asdict(cfg.model) if not isinstance(cfg.model, dict) else cfg.model,
    )
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    module = TinyLM(model, cfg)
    loader = torch.utils.data.DataLoader(
        train_windows,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    val_loader = torch.utils.data.DataLoader(heldout, batch_size=cfg.batch_size)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=cfg.max_steps,
        max_time={"minutes": cfg.max_minutes},
        val_check_interval=min(cfg.val_every, len(loader)),
        check_val_every_n_epoch=None,
        logger=CSVLogger("outputs/train_tiny_mla", name="csv"),  # the loss curve, outside the asset
        enable_checkpointing=False,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
    )
    trainer.fit(module, loader, val_loader)
    final = trainer.validate(module, val_loader, verbose=False)[0]

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, cfg.save_dtype)).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {
        "params": n_params,
        "train_tokens_seen": trainer.global_step * cfg.batch_size * cfg.seq_len,
        "steps": trainer.global_step,
        "train_loss_last": module.last_train_loss,
        "heldout_loss": final["heldout/loss"],
        "minutes": (time.time() - started) / 60,
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    return report


@hydra.main(version_base=None, config_path="../conf", config_name="train_tiny_mla")
def main(cfg) -> None:
    train(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
