"""`python -m quantmla.migrate [RESULTS_DIR] [--dry-run]`: re-key a results store written by older
code. Each record's config gains the fields added to the schemas since (at their defaults, which
reproduce the old behaviour: e.g. `model.fp8` only acts on FP8 checkpoints) and its `eval` block is
narrowed to its kind's own fields (each `eval.kind` hashes only those, `quantmla.job`); its folder
is renamed to the new hash, so finished jobs are found (and skipped) again. Idempotent; a record
whose new key is already taken is left in place and reported, never overwritten; records of other
entry points (their config without a `method`, e.g. experiments/smol_mla_reference.py) are left
alone.

Artifacts are never rewritten (a QuantMLA fit is ~16 MB; a store holds hundreds of MB): a model-config
hash written by older code, which hashed the loading checkout's path with the config, is verified
against this checkout's checkpoint (recomputed as that code did) and mapped to today's checkout-free
hash in `<artifacts>/retired_config_hashes.json`, through which every checkout finds and loads them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def with_new_fields(config: dict, defaults: dict) -> dict:
    """`config` with every schema field it lacks added at its default (its own values kept)."""
    out = dict(config)
    for key, default in defaults.items():
        if key not in out:
            out[key] = default
        elif isinstance(out[key], dict) and isinstance(default, dict):
            out[key] = with_new_fields(out[key], default)
    return out


def migrate(results_dir: Path, dry_run: bool = False) -> dict[str, int]:
    from omegaconf import OmegaConf

    from quantmla.config import RunConfig
    from quantmla.job import record_config
    from quantmla.tracking.store import config_hash, write_atomic

    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig), resolve=True)

    counts = {"moved": 0, "current": 0, "conflict": 0, "unreadable": 0, "not run records": 0}
    for path in sorted(results_dir.glob("*/*/result.json")):
        try:
            record = json.loads(path.read_text())
            if "method" not in record["config"]:  # another entry point's schema: not ours to re-key
                counts["not run records"] += 1
                continue
            config = record_config(with_new_fields(record["config"], defaults))
        except (ValueError, KeyError) as err:
            print(f"[migrate] skipped {path}: {err}", file=sys.stderr)
            counts["unreadable"] += 1
            continue
        key = config_hash(config)
        if key == path.parent.name and config == record["config"]:
            counts["current"] += 1
            continue
        target = path.parent.with_name(key)
        if target != path.parent and target.exists():
            print(f"[migrate] left {path}: {target} exists", file=sys.stderr)
            counts["conflict"] += 1
            continue
        print(f"[migrate] {path.parent.name} -> {key} ({path.parent.parent.name})")
        counts["moved"] += 1
        if dry_run:
            continue
        write_atomic(path, {**record, "config": config, "config_hash": key})
        path.parent.rename(target)
    return counts


def artifact_config_hashes(artifacts_dir: Path) -> dict[tuple[str, str], list[Path]]:
    """(model path, model-config hash) → the method artifacts and allocation files that hold it."""
    from quantmla.methods.base import read_metadata

    found: dict[tuple[str, str], list[Path]] = {}
    for file in sorted(artifacts_dir.glob("*/*")):
        if file.suffix == ".safetensors":
            metadata = read_metadata(file, {})
        elif file.suffix == ".json" and file.parent.name == "allocation":
            metadata = json.loads(file.read_text()).get("metadata", {})
        else:
            continue
        if "model_config_hash" in metadata:
            key = (metadata.get("model", ""), metadata["model_config_hash"])
            found.setdefault(key, []).append(file)
    return found


def older_config_hashes(config, checkpoint: str) -> dict[str, str]:
    """The hashes older code wrote for this config, loaded from `checkpoint` at each dtype a job
    may load it at (the config's `_name_or_path` and `dtype` as `from_pretrained` sets them) →
    today's `config_sha` at that dtype."""
    import torch

    from quantmla.methods.prepare import config_sha
    from quantmla.tracking.store import stable_hash

    hashes = {}
    for dtype in (config.dtype, torch.float32, torch.bfloat16, torch.float16):
        config.dtype = dtype
        for name in dict.fromkeys((checkpoint, str(Path(checkpoint).resolve()))):
            config._name_or_path = name
            hashes[stable_hash(config.to_dict(), 16)] = config_sha(config)
    return hashes


def retire_config_hashes(results_dir: Path, dry_run: bool = False) -> dict[str, int]:
    """Map every artifact's model-config hash that older code wrote to today's (`config_sha`),
    each verified against this checkout's checkpoint; hashes already current are left alone."""
    from omegaconf import OmegaConf

    from quantmla.config import PathsConfig
    from quantmla.methods.base import RETIRED_HASHES, retired_config_hashes
    from quantmla.models.loading import checkpoint_config
    from quantmla.paths import Paths
    from quantmla.tracking.store import write_atomic

    paths = Paths.from_config(OmegaConf.structured(PathsConfig))
    artifacts_dir = results_dir / "artifacts"
    retired = retired_config_hashes(artifacts_dir)
    counts = {"retired": 0, "current": 0, "checkpoint not here": 0, "unverified": 0}
    for (model, hash_), files in artifact_config_hashes(artifacts_dir).items():
        n = len(files)
        checkpoint = paths.checkpoint(model)
        if hash_ in retired:
            counts["current"] += n
            continue
        if not (Path(checkpoint) / "config.json").is_file():
            counts["checkpoint not here"] += n
            continue
        older = older_config_hashes(checkpoint_config(checkpoint), checkpoint)
        if hash_ in older.values():
            counts["current"] += n
            continue
        if hash_ not in older:
            print(f"[migrate] {model}: config hash {hash_} of {n} artifacts is not this checkout's "
                  f"({files[0].name}, ...)", file=sys.stderr)  # fmt: skip
            counts["unverified"] += n
            continue
        print(f"[migrate] {model}: config hash {hash_} -> {older[hash_]} ({n} artifacts)")
        retired[hash_] = older[hash_]
        counts["retired"] += n
    if counts["retired"] and not dry_run:
        write_atomic(artifacts_dir / RETIRED_HASHES, dict(sorted(retired.items())))
    return counts


def main(argv: list[str] | None = None) -> None:
    from quantmla.paths import repo_root

    parser = argparse.ArgumentParser(prog="python -m quantmla.migrate", description=__doc__)
    parser.add_argument("results_dir", nargs="?", help="the store (default: <repo>/results)")
    parser.add_argument("--dry-run", action="store_true", help="say what would move")
    args = parser.parse_args(argv)
    root = Path(args.results_dir) if args.results_dir else (repo_root() or Path.cwd()) / "results"
    if not root.is_dir():
        parser.error(f"no results store at {root}")
    for step in (migrate, retire_config_hashes):
        counts = step(root, args.dry_run)
        print("[migrate] " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
