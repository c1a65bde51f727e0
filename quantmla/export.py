"""`python -m quantmla.export model=... method=... precision=... out=DIR`: the job's model with the
method's transforms fused into its weights, saved as an ordinary Hugging Face checkpoint
(safetensors, `lm_head.weight` written explicitly: engines such as vLLM never tie it), its
tokenizer, and `quantmla.json` beside `config.json` — the quantizer spec, the protection window,
the method and the fingerprints of the source weights and of the transform artifact. Loading the
export with transformers and `quantmla.patch_model` (the spec and protection of quantmla.json)
computes exactly the job's function. QuaRot†'s post-RoPE Hadamard runs online, so it is refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMAT = "quantmla-export/1"
MANIFEST = "quantmla.json"


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
    out = Paths.from_config(cfg.paths).resolve(cfg.out)
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise ConfigError("out", str(out), "a new or empty folder (or overwrite=true)")
    check_writable(out, "out")
    return out


def manifest(job, prepared) -> dict:
    """What an engine needs to reproduce the job's cache, and where the weights came from."""
    from quantmla.tracking.store import stable_hash

    spec, policy, result = job.policy.spec, job.policy, prepared.method_result
    return {
        "format": FORMAT,
        "method": job.cfg.method.name,
        "precision": spec.precision,
        "quantizer": {
            "key": spec.key,
            "content_bits": spec.content_bits,
            "rope_bits": spec.rope_bits,
            "group_size": spec.group_size,
            "content_meta_dtype": spec.content_meta_dtype,
            "rope_meta_dtype": spec.rope_meta_dtype,
        },
        "protection": {"sink": policy.sink, "recent": policy.recent},
        "source": {"model": job.cfg.model.path, "weights": job.weights},
        "artifact": stable_hash(result.metadata, 16) if result is not None else None,
        "equivalence": {k: v for k, v in prepared.metrics.items() if k.startswith("equivalence/")},
    }


def export(cfg) -> Path:
    import torch

    from quantmla.job import resolve
    from quantmla.prepare import prepare
    from quantmla.simulator import unpatch_model

    out = check_out(cfg)
    job = resolve(cfg)
    prepared = prepare(job)
    model = unpatch_model(prepared.model)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() == embeddings.weight.data_ptr():  # untie: write lm_head itself
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.save_pretrained(out, safe_serialization=True)
    prepared.tokenizer.save_pretrained(out)
    (out / MANIFEST).write_text(json.dumps(manifest(job, prepared), indent=1, default=str) + "\n")
    print(
        f"[quantmla] exported {cfg.model.name} ({cfg.method.name}, {job.policy.spec.precision}) to {out}"
    )
    return out


def load_manifest(folder: str | Path) -> dict:
    """quantmla.json of an export; one line if it is missing or of another format."""
    from quantmla.errors import DataNotFoundError, QuantMLAError

    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DataNotFoundError(
            f"{folder}: no {MANIFEST}; make one with `python -m quantmla.export ... out={folder}`"
        )
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise QuantMLAError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    return data


def main() -> None:
    from quantmla.cli import hydra_app, route_precision

    sys.argv[1:] = route_precision(sys.argv[1:])
    hydra_app("export", export)


if __name__ == "__main__":
    main()
