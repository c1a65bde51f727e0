"""`python -m quantmla.migrate [RESULTS_DIR] [--dry-run]`: re-key a results store written by older
code. Each record's config gains the fields added to the schemas since (at their defaults, which
reproduce the old behaviour: e.g. `model.fp8` only acts on FP8 checkpoints) and its `eval` block is
narrowed to its kind's own fields (each `eval.kind` hashes only those, `quantmla.job`); its folder
is renamed to the new hash, so finished jobs are found (and skipped) again. Idempotent; a record
whose new key is already taken is left in place and reported, never overwritten; records of other
entry points (their config without a `method`, e.g. experiments/smol_mla_reference.py) are left
alone."""

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


def main(argv: list[str] | None = None) -> None:
    from quantmla.paths import repo_root

    parser = argparse.ArgumentParser(prog="python -m quantmla.migrate", description=__doc__)
    parser.add_argument("results_dir", nargs="?", help="the store (default: <repo>/results)")
    parser.add_argument("--dry-run", action="store_true", help="say what would move")
    args = parser.parse_args(argv)
    root = Path(args.results_dir) if args.results_dir else (repo_root() or Path.cwd()) / "results"
    if not root.is_dir():
        parser.error(f"no results store at {root}")
    counts = migrate(root, args.dry_run)
    print("[migrate] " + ", ".join(f"{v} {k}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
