"""The local results store: one self-describing JSON record per run, keyed by a config hash.

`results/<experiment>/<config-hash>/result.json` holds the resolved config, metrics, git SHA and
dirty flag, library versions, machine, wall time and creation time. The hash covers every field
that changes the result and none that does not (output folders, logger, force flag, threads), so
a re-run of a sweep finds finished jobs and skips them. Records are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

ATTACHED = "_"  # metrics keys an evaluator hands to the loggers only, never to the record
LM_EVAL_RESULTS = "_lm_eval/results"  # lm-eval's full results, attached for W&B

# Config keys (dotted paths) that never change a result: where things are written or read from,
# logging, and re-run control. The experiment name is part of the record's path instead.
# `cache`: the packed backend computes the simulator's function (tests/test_packed_generation.py)
NON_RESULT_KEYS = (
    "paths", "force", "threads", "logger", "hydra", "experiment_name", "cache",
    "model.build",  # how a testbed is built, not what it computes
    "eval.prefix_cache",  # lm-eval's scores with or without the shared-prefix cache
    "method.calibration.keep_teacher_outputs",  # a calibration's memory for speed, same fit
    "method.calibration.reuse_units",  # units taken from earlier fits are the fitted ones
)  # fmt: skip
TRACKED_PACKAGES = (
    "torch",
    "transformers",
    "quantmla",
    "lightning",
    "triton",
    "lm_eval",
    "hydra-core",
)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
WHOLE_FILE_BYTES = 64 << 20  # files up to this size are hashed whole
BLOCK, BLOCKS = 64 << 10, 256  # larger ones: their size and 256 evenly spaced 64 KiB blocks


def weights_fingerprint(folder: str | os.PathLike) -> str | None:
    """A short digest of a local checkpoint's weight files (None for a hub id), so that a record or
    a calibration artifact made on one set of weights is never reused for retrained ones under the
    same path. Cheap at any size: a 30 GB checkpoint reads 16 MiB per file."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for file in sorted({f for pattern in WEIGHT_FILES for f in folder.glob(pattern)}):
        size = file.stat().st_size
        h.update(f"{file.name}:{size};".encode())
        with file.open("rb") as f:
            if size <= WHOLE_FILE_BYTES:
                h.update(f.read())
                continue
            for i in range(BLOCKS):
                f.seek((size - BLOCK) * i // (BLOCKS - 1))
                h.update(f.read(BLOCK))
    return h.hexdigest()[:16]


def result_relevant(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The config without NON_RESULT_KEYS, at any depth."""
    kept = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if path in NON_RESULT_KEYS:
            continue
        kept[key] = result_relevant(value, f"{path}.") if isinstance(value, dict) else value
    return kept


def stable_hash(payload: Any, length: int = 12) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace), truncated."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:length]


def config_hash(config: dict[str, Any], length: int = 12) -> str:
    """Stable hash of the result-relevant part of a resolved config."""
    return stable_hash(result_relevant(config), length)


def record_path(results_dir: str | os.PathLike, experiment: str, config: dict[str, Any]) -> Path:
    return Path(results_dir) / experiment / config_hash(config) / "result.json"


PROGRESS = (
    "progress-"  # an unfinished job's saved work beside its record (lm-eval's answered requests)
)


def progress_path(record: Path, name: str) -> Path:
    """Where an unfinished job keeps `name`'s progress, so a stopped job resumes: in the record's
    folder (ignored by git), removed once the record is written (`clear_progress`)."""
    return record.with_name(PROGRESS + name)


def clear_progress(record: Path) -> None:
    for path in record.parent.glob(PROGRESS + "*"):
        path.unlink()


class Progress:
    """An unfinished job's measured values by key (JSON at `progress_path(record, name)`, rewritten
    atomically at each `save`): what a rerun of the job need not measure again. Without a record
    path nothing is kept."""

    def __init__(self, record: Path | None, name: str):
        self.path = None if record is None else progress_path(record, name)
        found = self.path is not None and self.path.is_file()
        self.values: dict[str, list] = json.loads(self.path.read_text()) if found else {}

    def get(self, key: str) -> list:
        return self.values.get(key, [])

    def save(self, key: str, values: list) -> None:
        """Keep `values`; a progress file that cannot be written stops the saving, not the job."""
        self.values[key] = list(values)
        if self.path is None:
            return
        try:
            write_atomic(self.path, self.values)
        except OSError as err:
            print(f"[quantmla] progress not saved ({self.path}: {err.strerror or err}): no resume")
            self.path = None


def git_state(repo: str | os.PathLike | None = None) -> dict[str, Any]:
    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {
            "git_sha": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"git_sha": None, "git_dirty": None}


def versions() -> dict[str, str | None]:
    found = {}
    for name in TRACKED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    return found


def machine() -> dict[str, Any]:
    import torch

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # runnable threads over the last 15 min at the end of the job: above `cpus`, it shared them
        "load_15m": os.getloadavg()[2] if hasattr(os, "getloadavg") else None,
    }


def write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON to a temporary file in the same folder, fsync, then rename over `path`.

    The record gets the usual umask-respecting mode (mkstemp's 0600 would hide it from the other
    users of a shared results folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".result-", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (user + system). Unlike wall time, a job
    paused or sharing the cores does not add to it: what a job costs the machine."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def make_record(
    config: dict[str, Any],
    metrics: dict[str, Any],
    experiment: str,
    wall_time_s: float,
    repo: str | os.PathLike | None = None,
    cpu_time_s: float | None = None,
) -> dict[str, Any]:
    return {
        "experiment": experiment,
        "config_hash": config_hash(config),
        "config": config,
        "metrics": metrics,
        **git_state(repo),
        "versions": versions(),
        "machine": machine(),
        "wall_time_s": wall_time_s,
        **({} if cpu_time_s is None else {"cpu_time_s": cpu_time_s}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


class CorruptRecordWarning(UserWarning):
    """A result.json that does not parse; it was skipped (and, for a job's own record, moved aside)."""


def _parse(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        warnings.warn(
            f"{path}: not a valid record ({err}); skipped", CorruptRecordWarning, stacklevel=3
        )
        return None
    return record if isinstance(record, dict) else None


def load_record(path: Path) -> dict[str, Any] | None:
    """The job's record, or None. A record that does not parse is moved aside (never deleted) to
    `result.json.corrupt-<time>` with one line naming both files, so its job is recomputed."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(path, aside)
        print(
            f"[quantmla] {path} is not a valid record: moved to {aside.name}; recomputing its job"
        )
        return None


def load_records(
    results_dir: str | os.PathLike, experiment: str | None = None
) -> list[dict[str, Any]]:
    """Every record under the store (or one experiment of it); a corrupt one is skipped with a
    `CorruptRecordWarning` naming it."""
    root = Path(results_dir) / (experiment or "")
    parsed = (_parse(p) for p in sorted(root.glob("**/result.json")))
    return [r for r in parsed if r is not None]
