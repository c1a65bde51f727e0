"""`python -m quantmla.run`: evaluate one (model, precision, method) and write its result record.

Validates the whole config first (nothing loads for a bad one, and the results folder must be
writable), skips the job if its record already exists (unless force=true), prepares the model
(`quantmla.prepare`), runs the registered evaluator of `eval.kind`, prints a table and writes
`results/<experiment>/<config-hash>/result.json`.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

HELP = """\
quantmla — function-aligned dual-path quantization of the MLA latent KV cache (QuantMLA).

Every job evaluates one (model, precision, method) and writes one record to
<paths.results_dir>/<experiment_name>/<config-hash>/result.json (a finished job is skipped).

Main commands
  python -m quantmla.run                                  preview: tiny model, RTN C4R4, ~1 min on 2 CPU cores
  python -m quantmla.run eval=perplexity                  the full evaluation behind the README's numbers
  python -m quantmla.run precision=c2r4 method=quantmla   one job (any c<x>r<y>: precision=c3r4 works too)
  python -m quantmla.run -m method=rtn,quarot precision=c4r4,c2r4      a sweep (resumes when rerun)
  python -m quantmla.run experiment=tiny_table1           a paper artifact's sweep (conf/experiment/)
  python -m quantmla.run eval=table1_suite eval.tasks=[piqa] eval.limit=50   lm-eval columns (also table2_suite, ruler)
  python -m quantmla.generate prompt="..." cache.backend=packed               generate through the packed cache
  python -m analysis.tables tiny_table1                   rebuild a table from the records
  python -m quantmla.run --cfg job [overrides]            print the composed config
  python -m quantmla.run --hydra-help                     Hydra's own options (launchers, sweeps)
"""

_running: dict = {}  # the job in progress, for the one-line Ctrl-C message


def run(cfg) -> dict | None:
    """One job: validate, skip if done, prepare, evaluate, record. Returns the record."""
    from omegaconf import OmegaConf

    from quantmla.config import validate
    from quantmla.tracking.store import load_record, record_path, weights_fingerprint

    evaluator, paths = validate(cfg)
    if cfg.precision.name == "bf16" and cfg.method.name != "rtn":
        print(
            f"[quantmla] precision=bf16 quantizes nothing: method={cfg.method.name} skipped (the rtn job is BF16)"
        )
        return None
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    # the weights are part of the job: a retrained checkpoint under the same path is a new record
    config["model"]["weights"] = weights_fingerprint(paths.checkpoint(cfg.model.path))
    path = record_path(paths.results_dir, cfg.experiment_name, config)
    _running.update(
        job=f"{cfg.model.name} {cfg.precision.name} {cfg.method.name} ({cfg.eval.kind})",
        experiment_dir=paths.results_dir / cfg.experiment_name,
    )
    existing = load_record(path)
    if existing is not None and not cfg.force:
        print(f"[quantmla] {path} exists: skipped (force=true recomputes)")
        print(evaluator.format_table(existing))
        return existing
    import torch

    from quantmla.paths import repo_root
    from quantmla.prepare import prepare
    from quantmla.tracking.store import make_record
    from quantmla.tracking.wandb_mirror import mirror

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    started = time.time()
    prepared = prepare(cfg, paths, load_model=evaluator.needs_model)
    metrics = {**prepared.metrics, **evaluator.evaluate(cfg, prepared)}
    record = make_record(
        config, metrics, cfg.experiment_name, time.time() - started, repo=repo_root()
    )
    print(evaluator.format_table(record))
    save_record(path, record)
    mirror(record, cfg.logger)
    print(f"[quantmla] wrote {path} ({record['wall_time_s']:.1f} s)")
    return record


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


def _interrupted() -> None:
    experiment = _running.get("experiment_dir")
    done = len(list(Path(experiment).glob("*/result.json"))) if experiment else 0
    job = _running.get("job", "before the first job started")
    print(
        f"\ninterrupted: {job}; {done} record(s) complete in {experiment or 'the results store'}; "
        "rerun the same command to resume",
        file=sys.stderr,
    )
    sys.exit(130)


_PRECISION_ARG = re.compile(r"(\+{0,2})precision=([^()]+)")


def _precision_presets() -> set[str]:
    return {
        p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "precision").glob("*.yaml")
    }


def route_precision(argv: list[str]) -> list[str]:
    """`precision=c3r4` (no preset file) means `precision.name=c3r4`: every preset only names its
    precision, so the two are the same job; the name is then validated in one line."""
    presets = _precision_presets()
    routed = []
    for arg in argv:
        match = _PRECISION_ARG.fullmatch(arg)
        if match and any(v not in presets for v in match.group(2).split(",")):
            arg = f"precision.name={match.group(2)}"
        routed.append(arg)
    return routed


def help_text() -> str:
    from quantmla.config import describe

    conf = Path(__file__).resolve().parents[1] / "conf"
    groups = sorted(p for p in conf.iterdir() if p.is_dir() and not p.name.startswith("."))
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


def hydra_app(config_name: str, job) -> None:
    """Run `job(config object)` as the Hydra app of `conf/<config_name>.yaml`; a QuantMLAError is
    one line on stderr and exit code 2."""
    import hydra

    import quantmla.config  # noqa: F401  (registers the structured-config schemas)

    conf = Path(__file__).resolve().parents[1] / "conf"

    @hydra.main(version_base=None, config_path=str(conf), config_name=config_name)
    def app(cfg) -> None:
        from omegaconf import OmegaConf

        from quantmla.errors import QuantMLAError

        try:
            job(OmegaConf.to_object(cfg))
        except QuantMLAError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    app()


def main() -> None:
    argv = sys.argv[1:]
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return
    sys.argv[1:] = route_precision(argv)
    try:
        hydra_app("config", run)
    except KeyboardInterrupt:
        _interrupted()


if __name__ == "__main__":
    main()
