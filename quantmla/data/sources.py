"""Raw text sources: WikiText-2 (raw) and C4 English validation, from a local folder or the hub.

A local folder is used when `data_dir` is given or `QUANTMLA_DATA_DIR` is set; otherwise the
Hugging Face hub. Both paths return the same thing (a list of documents/rows), so everything
downstream is identical.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from quantmla.errors import ConfigError, DataNotFoundError

DATA_DIR_ENV = "QUANTMLA_DATA_DIR"

# C4: the sample has 2,000 validation documents. The last `C4_EVAL_DOCS` are reserved for C4
# evaluation; the rest may be used to train the project's tiny model. Never mix the two.
C4_EVAL_DOCS = 300


@dataclass(frozen=True)
class Source:
    """Where one dataset split lives locally and on the hub."""

    local: str  # relative to the data dir
    hub: tuple[str, str | None]  # (path, name) for datasets.load_dataset
    hub_split: str


SOURCES: dict[str, dict[str, Source]] = {
    "wikitext2": {
        "valid": Source(
            "wikitext-2-raw-v1/wiki.valid.raw",
            ("Salesforce/wikitext", "wikitext-2-raw-v1"),
            "validation",
        ),
        "test": Source(
            "wikitext-2-raw-v1/wiki.test.raw", ("Salesforce/wikitext", "wikitext-2-raw-v1"), "test"
        ),
    },
    "c4": {
        # Both C4 splits are slices of the same validation documents (see C4_EVAL_DOCS).
        "train": Source(
            "c4-en-validation-sample/c4_validation_2k.jsonl", ("allenai/c4", "en"), "validation"
        ),
        "eval": Source(
            "c4-en-validation-sample/c4_validation_2k.jsonl", ("allenai/c4", "en"), "validation"
        ),
    },
    "gsm8k": {
        "train": Source("gsm8k/train.jsonl", ("openai/gsm8k", "main"), "train"),
        "test": Source("gsm8k/test.jsonl", ("openai/gsm8k", "main"), "test"),
    },
}


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The local data folder: the explicit argument, else $QUANTMLA_DATA_DIR, else None (hub)."""
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise DataNotFoundError(
            f"paths.data_dir={str(path)!r} is not a folder; point paths.data_dir=<folder> "
            f"(or ${DATA_DIR_ENV}) at a folder holding wikitext-2-raw-v1/ and c4-en-validation-sample/"
        )
    return path


def _source(dataset: str, split: str) -> Source:
    if dataset not in SOURCES:
        raise ConfigError("data.dataset", dataset, sorted(SOURCES))
    if split not in SOURCES[dataset]:
        raise ConfigError(f"split of {dataset}", split, sorted(SOURCES[dataset]))
    return SOURCES[dataset][split]


def _wikitext_rows(lines: list[str]) -> list[str]:
    """Rebuild HF rows from the raw file: non-blank lines keep a trailing newline, blank ones are ''."""
    return [line + "\n" if line.strip() else "" for line in lines]


def _c4_slice(docs: list[str], split: str) -> list[str]:
    return docs[:-C4_EVAL_DOCS] if split == "train" else docs[-C4_EVAL_DOCS:]


def _gsm8k_text(record: dict) -> str:
    return f"Question: {record['question']}\nAnswer: {record['answer']}"


def load_documents(
    dataset: str, split: str, data_dir: str | os.PathLike | None = None
) -> list[str]:
    """The documents (WikiText: HF rows) of a dataset split, local if a data dir is known, else hub."""
    source = _source(dataset, split)
    root = resolve_data_dir(data_dir)
    if root is not None:
        path = root / source.local
        if not path.is_file():
            raise DataNotFoundError(
                f"{dataset}/{split}: looked for {path} and found nothing; set paths.data_dir=<folder> "
                f"or ${DATA_DIR_ENV} to a folder with {source.local}"
            )
        if dataset == "wikitext2":
            docs = _wikitext_rows(path.read_text(encoding="utf-8").split("\n")[:-1])
        else:
            records = [
                json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line
            ]
            docs = [_gsm8k_text(r) if dataset == "gsm8k" else r["text"] for r in records]
    else:
        docs = _load_from_hub(dataset, source)
    return _c4_slice(docs, split) if dataset == "c4" else docs


def _load_from_hub(dataset: str, source: Source) -> list[str]:
    import datasets

    path, name = source.hub
    if dataset == "c4":
        # The first shard of C4 validation, as in GPTQ's C4 evaluation; 2,000 docs like the local sample.
        data = datasets.load_dataset(
            path,
            data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"},
            split="validation",
        )
        return [r["text"] for r in data.select(range(2000))]
    data = datasets.load_dataset(path, name, split=source.hub_split)
    if dataset == "gsm8k":
        return [_gsm8k_text(r) for r in data]
    return list(data["text"])


def load_text(dataset: str, split: str, data_dir: str | os.PathLike | None = None) -> str:
    """One joined text per split: GPTQ's "\\n\\n".join of rows (WikiText) or documents (C4, GSM8K)."""
    return "\n\n".join(load_documents(dataset, split, data_dir))
