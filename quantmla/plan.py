"""`python -m quantmla.plan experiment=... [hydra/launcher=slurm_8gpu]`: the memory plan
(`quantmla.planning`) of every job of a sweep, from the published configs and the eval config
alone — nothing is downloaded or loaded — and whether the chosen launcher's node holds each."""

from __future__ import annotations

import itertools
import sys

from quantmla.planning import GB, GPU_GB, NODE_GPUS, Plan, launcher_gpus, plan_job


def sweep_axes(params, overrides: list[str]) -> dict[str, list[str]]:
    """A multirun's axes as Hydra's basic sweeper reads them: the experiment's sweeper params, then
    the command line's overrides (a key given there replaces the param's); key → its overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [f"{k}={v}" for k, v in (params or {}).items()] + list(overrides)
    axes: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(given):
        key = override.get_key_element()
        values = (
            override.sweep_string_iterator()
            if override.is_discrete_sweep()
            else [override.get_value_element_as_str()]
        )
        axes[key] = [f"{key}={v}" for v in values]
    return axes


def sweep_jobs(params, overrides: list[str]) -> list[list[str]]:
    """Every job of that multirun: the product of its axes."""
    return [list(job) for job in itertools.product(*sweep_axes(params, overrides).values())]


def format_plans(plans: list[Plan]) -> str:
    lines = [
        "| job | weights | GB | capture GB (CPU) | working GB | KV GB | GPUs needed | node | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        node = "-" if p.gpus_available is None else str(p.gpus_available)
        fits = "-" if p.fits is None else ("yes" if p.fits else "**no**")
        lines.append(
            f"| {p.label} | {p.weights_dtype} | {p.weights / GB:,.1f} | {p.capture / GB:,.2f} | "
            f"{p.working / GB:,.2f} | {p.kv_cache / GB:,.2f} | {p.gpus_needed} | {node} | {fits} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Compose the sweep as `python -m quantmla.run` would, plan each distinct job, print a table."""
    import json

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import quantmla.config  # noqa: F401  (registers the structured-config schemas)
    from quantmla.cli import CONF_DIR, route_precision
    from quantmla.errors import QuantMLAError
    from quantmla.paths import Paths

    overrides = route_precision(list(sys.argv[1:] if argv is None else argv))
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            # the launcher and the sweeper's params, from the command line's single values
            single = [v[0] for v in sweep_axes({}, overrides).values() if len(v) == 1]
            top = compose("config", overrides=single, return_hydra_config=True)
            launcher, gpus = launcher_gpus(top.hydra)
            plans, seen = [], set()
            for job in sweep_jobs(top.hydra.sweeper.get("params"), overrides):
                cfg = OmegaConf.to_object(compose("config", overrides=job))
                paths = Paths.from_config(cfg.paths)
                if not cfg.model.config:
                    raise QuantMLAError(
                        f"model={cfg.model.name}: no published config (model.config)"
                    )
                raw = json.loads(paths.resolve(cfg.model.config).read_text())
                plan = plan_job(cfg, raw, gpus)
                if plan.label not in seen:
                    seen.add(plan.label)
                    plans.append(plan)
    except QuantMLAError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    node = (
        f"{gpus} GPU(s) of {GPU_GB:.0f} GB per node"
        if gpus is not None
        else f"no SLURM node: model.device=auto is one {NODE_GPUS}-GPU node, cuda one GPU"
    )
    print(f"launcher: {launcher} ({node}); plans from the published configs, nothing loaded\n")
    print(format_plans(plans))


if __name__ == "__main__":
    main()
