"""W&B mirror of the results store: one W&B run per job, one `artifact` run per experiment.

A job's run holds every metric of its record in a form W&B plots (`layout`): scalars in history and
summary; per-layer lists as one `<kind>/per_layer` table (columns named as in the paper: `_C`
content, `_P` positional) and as history rows keyed by `layer`; every other list as a table of its
own; calibration histories against `calibration/step`; lm-eval jobs through lm-eval's own
`WandbLogger` (results table, per-task metrics, sample predictions). What is not logged is listed
with its reason under `quantmla/not_logged`. The run config has the sweep axes at top level (model,
precision, method, eval_kind, seed, sweep) and the whole job config under `job`. Run ids come from
the record (experiment + config hash), and a job the store skips logs nothing, so a rerun sweep adds
no runs. Offline by default (no key); `logger.mode=online` (or WANDB_MODE) sends it. The store stays
the source of truth.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAPER_SUFFIXES = {"_content": "_C", "_rope": "_P"}  # R_content -> R_C, G_rope -> G_P
CALIBRATION_HISTORY = "method/report/history"
PER_LAYER_NAMES = {"nmse/attn_layers": "attn_nmse"}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of `a/b/c` keys (lists and scalars kept as they are)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def paper_name(name: str) -> str:
    for ours, paper in PAPER_SUFFIXES.items():
        if name.endswith(ours):
            return name[: -len(ours)] + paper
    return name


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _row_cells(prefix: str, value) -> dict[str, Any]:
    """One list element as named cells: a number or string as itself, a dict by its keys, a list
    by position."""
    if isinstance(value, dict):
        return {f"{prefix}/{k}": v for k, v in flatten(value).items()}
    if isinstance(value, list | tuple):
        return {f"{prefix}/{i}": v for i, v in enumerate(value)}
    return {prefix: value}


def _table(prefix: str, values: list) -> tuple[list[str], list[list]]:
    rows = [_row_cells(prefix, v) for v in values]
    columns = list(dict.fromkeys(c for row in rows for c in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    return columns, cells


def _cell(value):
    if value is None or _is_number(value) or isinstance(value, str | bool):
        return value
    return json.dumps(value)  # deeper nesting: kept, as text


@dataclass
class Layout:
    """A record's metrics as W&B takes them."""

    kind: str
    scalars: dict[str, float] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    per_layer: tuple[list[str], list[list]] | None = None
    tables: dict[str, tuple[list[str], list[list]]] = field(default_factory=dict)
    calibration: list[dict] = field(default_factory=list)
    not_logged: dict[str, str] = field(default_factory=dict)


def _layer_indices(flat: dict[str, Any]) -> tuple[str, list] | tuple[None, None]:
    """The record's layer axis: a `<study>/layers` list, else the layers of `nmse/attn_layers`."""
    for key, value in flat.items():
        if key.endswith("/layers") and isinstance(value, list) and value:
            return key[: -len("layers")], value
    attn = flat.get("nmse/attn_layers")
    return ("nmse/", list(range(len(attn)))) if isinstance(attn, list) and attn else (None, None)


def layout(record: dict[str, Any]) -> Layout:
    """Where each metric of `record` goes in W&B; nothing is left out without a stated reason."""
    flat = flatten(record["metrics"])
    out = Layout(kind=record["config"]["eval"]["kind"])
    family, layers = _layer_indices(flat)
    per_layer: dict[int, dict[str, Any]] = {}  # layer position -> its cells
    for key, value in flat.items():
        if isinstance(value, int | float):  # bools as 0 / 1
            out.scalars[key] = float(value)
        elif isinstance(value, str):
            out.text[key] = value
        elif value is None:
            out.not_logged[key] = "no value (null in the record)"
        elif not isinstance(value, list):
            out.not_logged[key] = f"a {type(value).__name__}, not a number, text or list"
        elif not value:
            out.not_logged[key] = "an empty list"
        elif key == CALIBRATION_HISTORY:
            out.calibration = value
        elif layers is not None and key == f"{family}layers":
            continue  # the layer column itself
        elif layers is not None and len(value) == len(layers) and _per_layer(key, family):
            name = PER_LAYER_NAMES.get(key) or paper_name(
                key.removeprefix(family).removeprefix("method/report/").removeprefix("allocation/")
            )
            for i, cells in enumerate(_row_cells(name, v) for v in value):
                per_layer.setdefault(i, {}).update(cells)
        else:
            out.tables[key] = _table("value", value)
    if per_layer:
        columns = ["layer", *dict.fromkeys(c for row in per_layer.values() for c in row)]
        rows = [
            [layers[i], *(_cell(row.get(c)) for c in columns[1:])] for i, row in per_layer.items()
        ]
        out.per_layer = (columns, rows)
    return out


PER_CANDIDATE = ("allocation/candidate_bytes", "allocation/joint_")  # lists over formats or picks


def _per_layer(key: str, family: str) -> bool:
    """A list with one entry per MLA layer: of the study that defines the layers, the per-layer
    attention NMSE, a method's per-layer calibration report, a mixed allocation's per-layer
    formats and errors (rows: layers, columns: candidates)."""
    if key.startswith(PER_CANDIDATE):
        return False
    return key.startswith((family, "nmse/attn_layers", "method/report/", "allocation/"))


def run_config(record: dict[str, Any], sweep: dict | None = None) -> dict[str, Any]:
    """The sweep axes at top level (W&B's table and parallel-coordinates views group by them);
    the whole job config under `job`."""
    cfg = record["config"]
    return {
        "model": cfg["model"]["name"],
        "precision": cfg["precision"]["name"],
        "method": cfg["method"]["name"],
        "eval_kind": cfg["eval"]["kind"],
        "seed": cfg.get("seed"),
        "experiment": record["experiment"],
        "sweep": (sweep or {}).get("id"),
        "overrides": (sweep or {}).get("overrides"),
        "config_hash": record["config_hash"],
        "git_sha": record["git_sha"],
        "job": cfg,
    }


def run_id(record: dict[str, Any]) -> str:
    """One W&B run per record: an online rerun of the same job resumes its run."""
    return f"{record['experiment']}-{record['config_hash']}"[-64:]


def _mode(logger_cfg) -> str:
    return os.environ.get("WANDB_MODE", logger_cfg.mode)


def mirror(
    record: dict[str, Any],
    logger_cfg,
    directory: str | None = None,
    sweep: dict | None = None,
    lm_eval_results: dict | None = None,
) -> str | None:
    """Log one finished record to W&B; returns the run id (None when logging is off).
    `sweep`: {"id", "overrides"} of the Hydra multirun the job belongs to; `lm_eval_results`:
    lm-eval's own results dict, logged by lm-eval's WandbLogger."""
    if logger_cfg is None or logger_cfg.name == "none":
        return None
    cfg = record["config"]
    names = [cfg["model"]["name"], cfg["precision"]["name"], cfg["method"]["name"]]
    tags = [*names, record["experiment"], cfg["eval"]["kind"]]
    if sweep and sweep.get("id"):
        tags.append(f"sweep:{sweep['id']}")
    run = _start(
        logger_cfg,
        directory,
        id=run_id(record),
        group=record["experiment"],
        job_type=cfg["eval"]["kind"],
        name="-".join([*names, record["config_hash"]]),
        tags=tags,
        config=run_config(record, sweep),
    )
    log_layout(run, layout(record))
    if lm_eval_results is not None:
        log_lm_eval(lm_eval_results)
    return _finish(run, "run")


def _start(logger_cfg, directory: str | None, **run_fields):
    """A W&B run in the logger's project and mode, resumed if its id exists, one printed line."""
    import wandb

    return wandb.init(
        project=logger_cfg.project,
        entity=logger_cfg.entity,
        resume="allow",
        mode=_mode(logger_cfg),
        dir=directory,
        reinit="finish_previous",
        settings=wandb.Settings(silent=True),  # one line (in _finish) instead of W&B's ~25
        **run_fields,
    )


def _finish(run, what: str) -> str:
    run_id_, run_dir = run.id, Path(run.dir).parent
    where = None if run.settings._offline else run.url
    run.finish()
    if where is None:
        print(f"[quantmla] W&B offline {what} {run_dir} (send it: wandb sync {run_dir})")
    else:
        print(f"[quantmla] W&B {what} {where}")
    return run_id_


def log_layout(run, out: Layout) -> None:
    import wandb

    run.log(out.scalars)
    if out.per_layer is not None:
        columns, rows = out.per_layer
        run.define_metric("layer")
        run.define_metric("per_layer/*", step_metric="layer")
        for row in rows:
            numbers = {f"per_layer/{c}": v for c, v in zip(columns[1:], row[1:]) if _is_number(v)}
            run.log({"layer": row[0], **numbers})
        run.log({f"{out.kind}/per_layer": wandb.Table(columns=columns, data=rows)})
    for key, (columns, rows) in out.tables.items():
        run.log({f"table/{key}": wandb.Table(columns=["index", *columns], data=_indexed(rows))})
    if out.calibration:
        run.define_metric("calibration/step")
        run.define_metric("calibration/*", step_metric="calibration/step")
    for row in out.calibration:  # per-layer held-out calibration losses, by calibration step
        run.log(
            {f"calibration/{k}": v for k, v in row.items() if k != "step"}
            | {"calibration/step": row["step"]}
        )
    run.summary.update(out.scalars | out.text)
    run.summary["quantmla/not_logged"] = out.not_logged


def _indexed(rows: list[list]) -> list[list]:
    return [[i, *row] for i, row in enumerate(rows)]


def log_lm_eval(results: dict) -> None:
    """lm-eval's own W&B logger on the current run: its results table and per-task metrics (and
    the sample predictions when lm-eval kept them)."""
    from lm_eval.loggers import WandbLogger

    logger = WandbLogger()  # attaches to the run already open
    logger.post_init(results)
    logger.log_eval_result()
    samples = results.get("samples") or {}
    # our local-data tasks sit in one-task wrapper groups that lm-eval reports as tasks without
    # a config: their members carry the samples
    tasks = [t for t in logger.task_names if t in samples and t in logger.task_configs]
    # lm-eval's sample table reads every metric of the task's config from every sample; a RULER
    # sample scores only its own length, so its columns are the metrics all samples have
    logger.task_configs = dict(logger.task_configs)
    for task in tasks:
        config = logger.task_configs[task] = dict(logger.task_configs[task])
        config["metric_list"] = [
            m
            for m in config.get("metric_list") or []
            if all(m.get("metric") in x for x in samples[task])
        ]
        logger.task_names = [task]
        try:
            logger.log_eval_samples({task: samples[task]})
        except KeyError as missing:  # trimmed samples (a vLLM job's) keep scores, not prompts
            print(f"[quantmla] W&B: no sample table for {task} (its samples lack {missing})")


PAPER_CELL = " (paper "


def split_paper_columns(rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """A regenerated table's rows (header first) with every `ours (paper x)` cell split into its
    column and a `<column> (paper)` column beside it, so W&B can sort and plot both."""
    header, body = rows[0], rows[1:]
    with_paper = [any(PAPER_CELL in row[i] for row in body) for i in range(len(header))]
    columns = []
    for name, paper in zip(header, with_paper):
        columns += [name, f"{name} (paper)"] if paper else [name]
    data = []
    for row in body:
        cells = []
        for cell, paper in zip(row, with_paper):
            ours, _, stated = cell.partition(PAPER_CELL)
            cells += [ours, stated.rstrip(")") or None] if paper else [cell]
        data.append(cells)
    return columns, data


def log_artifacts(
    experiment: str,
    logger_cfg,
    table: tuple[str, list[list[str]]] | None = None,
    figures: list[Path] = (),
    records_dir: Path | None = None,
    directory: str | None = None,
) -> str:
    """The experiment's `artifact` run (same group as its jobs): a regenerated table (ours beside
    the paper's numbers) as a W&B Table, figures as W&B Images, and the result records as a W&B
    Artifact (versioned by content: unchanged records add no version)."""
    import wandb

    run = _start(
        logger_cfg,
        directory,
        id=f"{experiment}-artifacts"[-64:],
        group=experiment,
        job_type="artifact",
        name=f"{experiment} artifacts",
        tags=[experiment, "artifact"],
        config={"experiment": experiment},
    )
    if table is not None:
        name, rows = table
        columns, data = split_paper_columns(rows)
        run.log({f"table/{name}": wandb.Table(columns=columns, data=data)})
    for path in figures:
        if Path(path).suffix == ".png":
            run.log({f"figure/{Path(path).stem}": wandb.Image(str(path))})
    if records_dir is not None:
        records = sorted(Path(records_dir).glob("*/result.json"))
        if records:
            artifact = wandb.Artifact(f"records-{experiment}", type="results")
            for path in records:
                artifact.add_file(str(path), name=f"{path.parent.name}/result.json")
            run.log_artifact(artifact)
    return _finish(run, "artifact run")


def load_records_from_wandb(
    project: str, experiment: str, entity: str | None = None
) -> list[dict[str, Any]]:
    """Records rebuilt from online W&B runs of one experiment (needs network and a key)."""
    import wandb

    path = f"{entity}/{project}" if entity else project
    records = []
    for run in wandb.Api().runs(path, filters={"group": experiment}):
        if run.job_type == "artifact":
            continue
        config = run.config.get("job") or {
            k: v for k, v in run.config.items() if k not in ("config_hash", "git_sha")
        }  # runs logged before the axes moved to top level
        metrics = {k: v for k, v in run.summary.items() if not k.startswith(("_", "quantmla/"))}
        records.append(
            {
                "experiment": experiment,
                "config": config,
                "metrics": metrics,
                "config_hash": run.config.get("config_hash"),
            }
        )
    return records
