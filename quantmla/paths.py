"""Every root the project reads or writes (the `paths` config group), resolved in one place.

Relative paths resolve against `paths.root`: by default the repository root of a source checkout
(so `assets/tiny-mla` and `../shared/data` work from any working directory), else the working
directory."""

from __future__ import annotations

import functools
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from quantmla.errors import CheckpointError, DataNotFoundError


def repo_root() -> Path | None:
    """The source checkout holding this package (it has `conf/` beside `quantmla/`), else None."""
    candidate = Path(__file__).resolve().parents[1]
    return candidate if (candidate / "conf").is_dir() else None


@dataclass(frozen=True)
class Paths:
    root: Path
    data_dir: Path | None  # None: the hub (or $QUANTMLA_DATA_DIR, see quantmla.data)
    results_dir: Path
    artifacts_dir: Path
    checkpoints_dir: Path
    serve_python: Path | None = None  # the serving venv's python (vLLM jobs)

    @classmethod
    def from_config(cls, cfg) -> Paths:
        root = Path(cfg.root).expanduser() if cfg.root else (repo_root() or Path.cwd())

        def under(p, base=root):
            p = Path(os.path.expanduser(str(p)))
            return p if p.is_absolute() else base / p

        results = under(cfg.results_dir)
        return cls(
            root=root,
            data_dir=under(cfg.data_dir) if cfg.data_dir else None,
            results_dir=results,
            artifacts_dir=under(cfg.artifacts_dir) if cfg.artifacts_dir else results / "artifacts",
            checkpoints_dir=under(cfg.checkpoints_dir) if cfg.checkpoints_dir else root,
            serve_python=under(cfg.serve_python) if getattr(cfg, "serve_python", None) else None,
        )

    def resolve(self, path: str | os.PathLike) -> Path:
        p = Path(os.path.expanduser(str(path)))
        return p if p.is_absolute() else self.root / p

    def checkpoint(self, model_path: str) -> str:
        """A local checkpoint folder (absolute, or relative to checkpoints_dir) or the hub id as given."""
        p = Path(os.path.expanduser(model_path))
        if p.is_absolute() or model_path.startswith("."):
            return str(self.resolve(p))
        local = self.checkpoints_dir / p
        return str(local) if local.exists() else model_path


def local_config_json(path_or_id: str) -> Path | None:
    """config.json of a local checkpoint folder, None for a hub id. A path that looks local but
    holds no config.json stops with one line: the only checkpoint-path check."""
    local = Path(path_or_id).expanduser()
    if not (path_or_id.startswith((".", "/", "~")) or local.exists()):
        return None
    if not (local / "config.json").is_file():
        raise DataNotFoundError(
            f"model.path={path_or_id!r}: no config.json there; set model.path to a checkpoint folder or a hub id"
        )
    return local / "config.json"


OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@functools.cache
def hub_offline(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub cannot be used: an offline flag is set, or its endpoint does not
    answer a TCP connection within `timeout_s` (no flag needed on a machine without network)."""
    if any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in OFFLINE_FLAGS):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout_s).close()
    except OSError:
        return True
    return False


def check_safetensors(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every `*.safetensors` file of a local checkpoint is whole: its size equals the 8-byte header
    length + the JSON header + the last tensor's end offset. One line naming the file otherwise
    (a truncated copy used to surface as a 25-line SafetensorError naming nothing). Returns every
    tensor's shape, from the headers (nothing else is read)."""
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        size = file.stat().st_size
        try:
            with file.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if header_len <= 0 or 8 + header_len > size:
                    raise ValueError(f"header of {header_len} bytes")
                header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            end = max((v["data_offsets"][1] for v in header.values()), default=0)
            shapes.update({name: tuple(v["shape"]) for name, v in header.items()})
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None
        if size != 8 + header_len + end:
            raise CheckpointError(
                f"{file}: truncated or corrupt ({size:,} bytes; its header describes "
                f"{8 + header_len + end:,}); copy the checkpoint again"
            )
    return shapes
