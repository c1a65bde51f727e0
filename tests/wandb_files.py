"""Reading W&B offline runs back as W&B wrote them: the `.wandb` log's records parsed with W&B's own
protobuf definitions, and the run's table and media files. The log (wandb 0.31) is a 7-byte header
then a LevelDB-style log of 32 KiB blocks; each chunk has a 7-byte header (CRC-32C, length, type:
full / first / middle / last) and a block's tail shorter than a header is padding."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

BLOCK, CHUNK_HEADER, FILE_HEADER = 32 * 1024, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B log"
    pos, records, parts = FILE_HEADER, [], []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            records.append(b"".join([*parts, chunk]))
    return records


@dataclass
class OfflineRun:
    folder: Path
    run_id: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    artifacts: list = field(default_factory=list)

    def table(self, key: str) -> dict:
        """A logged wandb.Table as W&B stored it: {"columns": [...], "data": [[...]]}."""
        entry = next(row[key] for row in self.history if key in row)
        return json.loads((self.folder / "files" / entry["path"]).read_text())

    def tables(self) -> list[str]:
        return [k for row in self.history for k, v in row.items() if _is_media(v, "table-file")]

    def images(self) -> dict[str, Path]:
        return {
            k: self.folder / "files" / v["path"]
            for row in self.history
            for k, v in row.items()
            if _is_media(v, "image-file")
        }


def _is_media(value, kind: str) -> bool:
    return isinstance(value, dict) and value.get("_type") == kind


def _set(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _items(items) -> dict:
    out = {}
    for item in items:
        _set(out, list(item.nested_key) or [item.key], json.loads(item.value_json))
    return out


def read_run(folder: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2

    (log,) = folder.glob("run-*.wandb")
    run = OfflineRun(folder)
    for raw in raw_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.run_id, run.group, run.job_type, run.tags = (
                r.run_id,
                r.run_group,
                r.job_type,
                list(r.tags),
            )
            run.config.update(_items(r.config.update))
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
        elif kind == "artifact":
            run.artifacts.append(record.artifact)
    return run


def offline_runs(root: Path) -> list[OfflineRun]:
    """Every offline run under root, read after W&B's service has exited: `run.finish()` returns
    before the service closes the run's log, so a log read right away can still be unflushed."""
    import wandb

    wandb.teardown()
    return [read_run(f) for f in sorted(Path(root).glob("**/offline-run-*"))]
