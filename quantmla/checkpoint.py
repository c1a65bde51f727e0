"""A prepared job's model as an ordinary Hugging Face checkpoint plus `quantmla.json` (the
quantizer spec, the protection window, the method and the fingerprints of the source weights and
the transform artifact): what `python -m quantmla.export` writes and what engines serve.

`lm_head.weight` is written explicitly (engines such as vLLM never tie it); the method's
transforms are already fused into the weights, so the architecture and weight names are unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "quantmla-export/1"
MANIFEST = "quantmla.json"


def manifest(cfg, prepared) -> dict:
    """What an engine needs to reproduce the job's cache, and where the weights came from."""
    from quantmla.tracking.store import stable_hash

    policy, result = prepared.policy, prepared.method_result
    spec = policy.spec
    return {
        "format": FORMAT,
        "method": cfg.method.name,
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
        "source": {"model": cfg.model.path, "weights": prepared.weights},
        "artifact": stable_hash(result.metadata, 16) if result is not None else None,
        "equivalence": {k: v for k, v in prepared.metrics.items() if k.startswith("equivalence/")},
    }


def save_untied(model, tokenizer, out: Path) -> Path:
    """An HF checkpoint folder with `lm_head.weight` written (engines such as vLLM never tie it)."""
    import torch

    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() == embeddings.weight.data_ptr():  # untie: write lm_head itself
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def write_checkpoint(cfg, prepared, out: Path) -> Path:
    """Save the prepared (fused) model untied and unpatched, its tokenizer and quantmla.json."""

    from quantmla.simulator import unpatch_model

    save_untied(unpatch_model(prepared.model), prepared.tokenizer, out)
    (out / MANIFEST).write_text(json.dumps(manifest(cfg, prepared), indent=1, default=str) + "\n")
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
