"""`python -m quantmla.migrate [RESULTS_DIR] [--dry-run]`: re-key a results store made before each
`eval.kind` hashed only its own fields (quantmla.job). Each record's config gets its `eval` block
narrowed to the kind's fields and its folder renamed to the new hash, so finished jobs are found
(and skipped) again. Idempotent; a record whose new key is already taken is left in place and
reported, never overwritten."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def migrate(results_dir: Path, dry_run: bool = False) -> dict[str, int]:
    from quantmla.job import narrow_eval
    from quantmla.tracking.store import config_hash, write_atomic

    counts = {"moved": 0, "current": 0, "conflict": 0, "unreadable": 0}
    for path in sorted(results_dir.glob("*/*/result.json")):
        try:
            record = json.loads(path.read_text())
            config = narrow_eval(record["config"])
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
