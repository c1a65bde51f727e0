"""W&B mirror of the results store: one W&B run per job, grouped and tagged by experiment, model,
precision and method. Offline by default (no key needed); `logger.mode=online` (or WANDB_MODE)
sends it. The store stays the source of truth: offline W&B writes no summary, so results are
never read back from offline files; online users can rebuild tables from the W&B API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def mirror(record: dict[str, Any], logger_cfg, directory: str | None = None) -> str | None:
    """Log one finished record to W&B; returns the run id (None when logging is off)."""
    if logger_cfg is None or logger_cfg.name == "none":
        return None
    import wandb

    cfg, metrics = record["config"], record["metrics"]
    tags = [
        cfg["model"]["name"],
        cfg["precision"]["name"],
        cfg["method"]["name"],
        record["experiment"],
    ]
    run = wandb.init(
        project=logger_cfg.project,
        entity=logger_cfg.entity,
        group=record["experiment"],
        job_type=cfg["method"]["name"],
        name=f"{cfg['model']['name']}-{cfg['precision']['name']}-{cfg['method']['name']}-{record['config_hash']}",
        tags=tags,
        config={**cfg, "config_hash": record["config_hash"], "git_sha": record["git_sha"]},
        mode=os.environ.get("WANDB_MODE", logger_cfg.mode),
        dir=directory,
        reinit="finish_previous",
        settings=wandb.Settings(silent=True),  # one line below instead of W&B's ~25
    )
    run.log(_scalars(metrics))
    layers = metrics.get("nmse/attn_layers")
    if layers:
        run.log(
            {
                "nmse/attn_layers": wandb.Table(
                    columns=["layer", "nmse"], data=[[i, v] for i, v in enumerate(layers)]
                )
            }
        )
    history = (metrics.get("method/report") or {}).get("history") or []
    for row in history:  # per-layer held-out calibration losses, by calibration step
        run.log(
            {f"calibration/{k}": v for k, v in row.items() if k != "step"}
            | {"calibration/step": row["step"]}
        )
    run.summary.update(_scalars(metrics))
    run_id, run_dir = run.id, Path(run.dir).parent
    where = None if run.settings._offline else run.url
    run.finish()
    if where is None:
        print(f"[quantmla] W&B offline run {run_dir} (send it: wandb sync {run_dir})")
    else:
        print(f"[quantmla] W&B run {where}")
    return run_id


def load_records_from_wandb(
    project: str, experiment: str, entity: str | None = None
) -> list[dict[str, Any]]:
    """Records rebuilt from online W&B runs of one experiment (needs network and a key)."""
    import wandb

    path = f"{entity}/{project}" if entity else project
    records = []
    for run in wandb.Api().runs(path, filters={"group": experiment}):
        config = {k: v for k, v in run.config.items() if k not in ("config_hash", "git_sha")}
        metrics = {k: v for k, v in run.summary.items() if not k.startswith("_")}
        records.append(
            {
                "experiment": experiment,
                "config": config,
                "metrics": metrics,
                "config_hash": run.config.get("config_hash"),
            }
        )
    return records
