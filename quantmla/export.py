"""`python -m quantmla.export model=... method=... precision=... out=DIR`: the job's model with the
method's transforms fused into its weights, saved as an ordinary Hugging Face checkpoint
(safetensors, `lm_head.weight` written explicitly: engines such as vLLM never tie it), its
tokenizer, and `quantmla.json` beside `config.json` — the quantizer spec, the protection window,
the method and the fingerprints of the source weights and of the transform artifact. Loading the
export with transformers and `quantmla.patch_model` (the spec and protection of quantmla.json)
computes exactly the job's function. QuaRot†'s post-RoPE Hadamard runs online, so it is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path


def check_out(cfg) -> Path:
    """One line, before anything loads, for an export that cannot be written or is not fusable."""
    from quantmla.errors import ConfigError
    from quantmla.job import check_writable
    from quantmla.methods.registry import METHODS
    from quantmla.paths import Paths

    if not cfg.out:
        raise ConfigError("out", cfg.out, "a folder for the exported checkpoint (out=DIR)")
    method = METHODS.get(cfg.method.name)
    if method is not None and not method.fully_fused:
        raise ConfigError(
            "method.name",
            cfg.method.name,
            "a method whose transforms fuse into the weights (rtn, smoothquant, quantmla): "
            f"{method.label} applies a post-RoPE Hadamard online, which a checkpoint cannot carry",
        )
    calibration = cfg.method.calibration
    if method is not None and method.calibrated and calibration and calibration.rope_hadamard:
        raise ConfigError(
            "method.calibration.rope_hadamard",
            True,
            "false: the post-RoPE Hadamard runs online, which a checkpoint cannot carry",
        )
    out = Paths.from_config(cfg.paths).resolve(cfg.out)
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise ConfigError("out", str(out), "a new or empty folder (or overwrite=true)")
    check_writable(out, "out")
    return out


def export(cfg) -> Path:
    from quantmla.checkpoint import write_checkpoint
    from quantmla.job import resolve
    from quantmla.prepare import prepare

    out = check_out(cfg)
    job = resolve(cfg)
    write_checkpoint(cfg, prepare(job), out)
    print(
        f"[quantmla] exported {cfg.model.name} ({cfg.method.name}, {job.policy.spec.precision}) to {out}"
    )
    return out


def main() -> None:
    from quantmla.cli import hydra_app, route_precision

    sys.argv[1:] = route_precision(sys.argv[1:])
    hydra_app("export", export)


if __name__ == "__main__":
    main()
