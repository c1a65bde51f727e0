"""What the command-line entry points share: the Hydra app around a job function (a QuantMLAError is
one line on stderr and exit code 2) and the `precision=c3r4` shorthand."""

from __future__ import annotations

import re
import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
_PRECISION_ARG = re.compile(r"(\+{0,2})precision=([^()]+)")
DEFAULT_PRECISION = "c4r4"  # conf/config.yaml's


def _precision_presets() -> set[str]:
    return {p.stem for p in (CONF_DIR / "precision").glob("*.yaml")}


def route_precision(argv: list[str]) -> list[str]:
    """`precision=c3r4` (no preset file) means `precision.name=c3r4`: every preset only names its
    precision, so the two are the same job; the name is then validated in one line. The group is
    pinned to the default preset, so an experiment's own sweep over the group does not multiply
    the job (it would run once and be skipped as a duplicate per swept preset)."""
    presets = _precision_presets()
    routed = []
    for arg in argv:
        match = _PRECISION_ARG.fullmatch(arg)
        if match and any(v not in presets for v in match.group(2).split(",")):
            routed += [f"precision={DEFAULT_PRECISION}", f"precision.name={match.group(2)}"]
        else:
            routed.append(arg)
    return routed


def hydra_app(config_name: str, job) -> None:
    """Run `job(config object)` as the Hydra app of `conf/<config_name>.yaml`."""
    import hydra

    import quantmla.config  # noqa: F401  (registers the structured-config schemas)

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name=config_name)
    def app(cfg) -> None:
        from omegaconf import OmegaConf

        from quantmla.errors import QuantMLAError

        try:
            job(OmegaConf.to_object(cfg))
        except QuantMLAError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)

    app()
