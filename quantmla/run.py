"""`python -m quantmla.run`: evaluate one (model, precision, method) and write its result record.

Validates the whole config first (nothing loads for a bad one, and the results folder must be
writable), skips the job if its record already exists (unless force=true), prepares the model
(`quantmla.prepare`), runs the registered evaluator of `eval.kind`, prints a table and writes
`results/<experiment>/<config-hash>/result.json`. A job stopped mid-way resumes from the progress
it saved beside that record (perplexity windows, lm-eval answers), removed once the record is written.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HELP = """\
quantmla — function-aligned dual-path quantization of the MLA latent KV cache (QuantMLA).

Every job evaluates one (model, precision, method) and writes one record to
<paths.results_dir>/<experiment_name>/<config-hash>/result.json (a finished job is skipped).

Main commands
  python -m quantmla.run                                  preview: tiny model, BF16 + RTN C4R4, 48 windows (~20 s)
  python -m quantmla.run eval=perplexity                  the full evaluation behind the documented numbers
  python -m quantmla.run precision=c2r4 method=quantmla   one job (any c<x>r<y>: precision=c3r4 works too)
  python -m quantmla.run -m method=rtn,quarot precision=c4r4,c2r4      a sweep (resumes when rerun)
  python -m quantmla.run experiment=tiny_table1           a paper artifact's sweep (conf/experiment/)
  python -m quantmla.run eval=table1_suite eval.tasks=[piqa] eval.limit=50   lm-eval columns (also table2_suite, ruler)
  python -m quantmla.generate "prompt=any text, even this" cache.backend=packed   generate (or prompt_file=PATH|-)
  python -m quantmla.migrate results                      re-key a store written before per-kind hashes
  python -m analysis.tables tiny_table1                   rebuild a table from the records
  python -m quantmla.run --cfg job [overrides]            print the composed config
  python -m quantmla.run --hydra-help                     Hydra's own options (launchers, sweeps)
"""

_running: dict = {"written": 0}  # the job in progress and the records this process wrote


def run(cfg) -> dict | None:
    """One job: validate (resolve), skip if done, prepare, evaluate, record. Returns the record."""
    from quantmla.job import resolve
    from quantmla.tracking.store import load_record

    job = resolve(cfg)
    if cfg.precision.name == "bf16" and cfg.method.name != "rtn":
        print(
            f"[quantmla] precision=bf16 quantizes nothing: method={cfg.method.name} skipped (the rtn job is BF16)"
        )
        return None
    _running.update(
        job=f"{cfg.model.name} {cfg.precision.name} {cfg.method.name} ({cfg.eval.kind})",
        experiment_dir=job.paths.results_dir / cfg.experiment_name,
    )
    existing = load_record(job.record_path)
    if existing is not None and not cfg.force:
        print(f"[quantmla] {job.record_path} exists: skipped (force=true recomputes)")
        print(job.evaluator.format_table(existing))
        return existing
    import torch

    from quantmla.paths import repo_root
    from quantmla.prepare import prepare
    from quantmla.tracking.store import (
        ATTACHED,
        LM_EVAL_RESULTS,
        clear_progress,
        cpu_seconds,
        make_record,
    )
    from quantmla.tracking.wandb_mirror import mirror

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    started, cpu_started = time.time(), cpu_seconds()
    prepared = prepare(job)
    evaluated = job.evaluator.evaluate(job.cfg, prepared)  # may add to prepared.metrics (resumed/*)
    metrics = {**prepared.metrics, **evaluated}
    attached = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(ATTACHED)]}
    record = make_record(
        job.config,
        metrics,
        cfg.experiment_name,
        time.time() - started,
        repo=repo_root(),
        cpu_time_s=cpu_seconds() - cpu_started,
    )
    print(job.evaluator.format_table(record))
    save_record(job.record_path, record)
    clear_progress(job.record_path)
    _running["written"] += 1
    mirror(record, cfg.logger, sweep=current_sweep(), lm_eval_results=attached.get(LM_EVAL_RESULTS))
    print(f"[quantmla] wrote {job.record_path} ({record['wall_time_s']:.1f} s)")
    return record


def current_sweep() -> dict | None:
    """The Hydra multirun this job belongs to: {"id": its sweep folder, "overrides": the job's own
    overrides}; None for a single run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if str(hydra.mode) != "RunMode.MULTIRUN":
        return None
    sweep_dir = Path(hydra.sweep.dir)
    return {
        "id": "_".join(sweep_dir.parts[-2:]).replace(":", "-"),
        "overrides": list(hydra.overrides.task),
    }


def save_record(path: Path, record: dict) -> None:
    """Write the record; if that fails, the metrics are printed (the table already was) so nothing
    computed is lost, and the error names the path."""
    import json

    from quantmla.errors import QuantMLAError
    from quantmla.tracking.store import write_atomic

    try:
        write_atomic(path, record)
    except OSError as err:
        print(json.dumps(record["metrics"], indent=1, default=str))
        raise QuantMLAError(
            f"could not write the record to {path} ({err.strerror or err}); its metrics are printed above"
        ) from None


def interrupted_message() -> str:
    """The one line after Ctrl-C: the job cut short and the records *this* command wrote."""
    experiment = _running.get("experiment_dir")
    job = _running.get("job", "before the first job started")
    where = f" in {experiment}" if experiment else ""
    return (
        f"interrupted: {job}; this command completed {_running['written']} record(s){where}; "
        "rerun the same command to resume"
    )


def _interrupted() -> None:
    print(f"\n{interrupted_message()}", file=sys.stderr)
    sys.exit(130)


def help_text() -> str:
    from quantmla.cli import CONF_DIR
    from quantmla.config import describe

    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("."))
    lines = [HELP, "Config groups (group=option)"]
    for g in groups:
        options = sorted(p.stem for p in g.glob("*.yaml")) or sorted(
            f"{p.name}/…" for p in g.iterdir() if p.is_dir()
        )
        lines.append(f"  {g.name}: {', '.join(options)}")
    lines += ["", "Fields (field=value; defaults before the group presets apply)"]
    for name, default, text in describe():
        lines.append(f"  {name:<34} {default:<14} {text}")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return
    from quantmla.cli import hydra_app, route_precision

    _running.clear()
    _running["written"] = 0
    sys.argv[1:] = route_precision(argv)
    try:
        hydra_app("config", run)
    except KeyboardInterrupt:
        _interrupted()


if __name__ == "__main__":
    main()
