"""Documents for the project's lm-eval task YAMLs, read from the local data folder.

Each `custom_dataset` function returns the splits the upstream lm-eval task reads, with the
upstream dataset's field names, so the upstream prompt, choices, target, metric and few-shot
split apply unchanged. lm-eval calls them with the task's metadata (our TaskManager adds
`data_dir`) and `dataset_kwargs`."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import datasets


def _data_dir(kwargs) -> Path:
    if not kwargs.get("data_dir"):
        raise ValueError("local lm-eval tasks need metadata data_dir (paths.data_dir)")
    return Path(kwargs["data_dir"])


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _splits(**splits: list[dict]) -> dict[str, datasets.Dataset]:
    return {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}


def hellaswag_rows(path: Path) -> list[dict]:
    """llama.cpp's HellaSwag text (6 lines per task: `label: context`, gold, 4 endings) in the
    Rowan/hellaswag fields. The context is whole in `ctx_a` (`ctx_b` empty): the file does not
    keep the split, so upstream's capitalisation of `ctx_b`'s first letter cannot be applied."""
    lines = path.read_text(encoding="utf-8").split("\n")
    rows = []
    for i in range(0, len(lines) - 5, 6):
        label, _, ctx = lines[i].partition(": ")
        rows.append(
            {
                "activity_label": label,
                "ctx_a": ctx,
                "ctx_b": "",
                "endings": lines[i + 2 : i + 6],
                "label": lines[i + 1].strip(),
            }
        )
    return rows


def hellaswag(**kwargs):
    rows = hellaswag_rows(_data_dir(kwargs) / "hellaswag" / "hellaswag_val_full.txt")
    return _splits(validation=rows)


def piqa(**kwargs):
    folder = _data_dir(kwargs) / "piqa"
    docs = _jsonl(folder / "valid.jsonl")
    labels = (folder / "valid-labels.lst").read_text().split()
    if len(labels) != len(docs):
        raise ValueError(f"piqa: {len(docs)} documents but {len(labels)} labels in {folder}")
    rows = [{**d, "label": int(y)} for d, y in zip(docs, labels)]
    return _splits(validation=rows)


def arc_rows_llm_foundry(path: Path) -> list[dict]:
    """llm-foundry's ARC (`query` = "Question: …", `choices`, `gold`) in allenai/ai2_arc fields
    (labels A, B, C, …: the file keeps no original labels)."""
    rows = []
    for i, d in enumerate(_jsonl(path)):
        labels = [chr(ord("A") + k) for k in range(len(d["choices"]))]
        rows.append(
            {
                "id": f"{path.stem}-{i}",
                "question": d["query"].removeprefix("Question: "),
                "choices": {"text": d["choices"], "label": labels},
                "answerKey": labels[d["gold"]],
            }
        )
    return rows


def arc_rows_original(path: Path) -> list[dict]:
    """AI2's original ARC jsonl (`question.stem`, `question.choices`) in allenai/ai2_arc fields."""
    return [
        {
            "id": d["id"],
            "question": d["question"]["stem"],
            "choices": {
                "text": [c["text"] for c in d["question"]["choices"]],
                "label": [c["label"] for c in d["question"]["choices"]],
            },
            "answerKey": d["answerKey"],
        }
        for d in _jsonl(path)
    ]


def arc_easy(**kwargs):
    path = _data_dir(kwargs) / "arc" / "llm-foundry_icl" / "arc_easy_test.jsonl"
    return _splits(test=arc_rows_llm_foundry(path))


def arc_challenge(**kwargs):
    path = _data_dir(kwargs) / "arc" / "llm-foundry_icl" / "arc_challenge_test.jsonl"
    return _splits(test=arc_rows_llm_foundry(path))


def winogrande(**kwargs):
    """llm-foundry's WinoGrande dev: the sentence is already split at the blank, so the local
    task reads `context_options`/`continuation` (winogrande_* functions below) instead of
    upstream's `sentence`/`option1`/`option2`/`answer`."""
    path = _data_dir(kwargs) / "winogrande" / "llm-foundry_icl" / "winogrande_dev.jsonl"
    return _splits(validation=_jsonl(path))


def winogrande_doc_to_text(doc) -> int:
    return doc["gold"]


def winogrande_doc_to_target(doc) -> str:
    return doc["continuation"].strip()


def winogrande_doc_to_choice(doc) -> list[str]:
    return list(doc["context_options"])


def mmlu_rows(path: Path, subject: str) -> list[dict]:
    """The converted MMLU CSV (header, answer index) in cais/mmlu fields."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        return [
            {
                "question": r["question"],
                "subject": subject,
                "choices": [r[f"choice{k}"] for k in range(4)],
                "answer": int(r["answer"]),
            }
            for r in reader
        ]


def mmlu_rows_original(path: Path, subject: str) -> list[dict]:
    """hendrycks' original MMLU CSV (no header, letter answers) in cais/mmlu fields."""
    with open(path, encoding="utf-8", newline="") as f:
        return [
            {
                "question": r[0],
                "subject": subject,
                "choices": r[1:5],
                "answer": "ABCD".index(r[5].strip()),
            }
            for r in csv.reader(f)
        ]


def mmlu(subject: str, **kwargs):
    folder = _data_dir(kwargs) / "mmlu"
    return _splits(
        test=mmlu_rows(folder / "test" / f"{subject}_test.csv", subject),
        dev=mmlu_rows(folder / "dev" / f"{subject}_dev.csv", subject),
    )


def gsm8k(**kwargs):
    folder = _data_dir(kwargs) / "gsm8k"
    return _splits(train=_jsonl(folder / "train.jsonl"), test=_jsonl(folder / "test.jsonl"))


def reference_bits_per_byte(doc, results) -> dict[str, float]:
    """A teacher-forced reference's bits per UTF-8 byte: the continuation lm-eval scored is
    the task's target, " " + answer."""
    loglikelihood, _ = results[0]
    return {"bpb": -loglikelihood / math.log(2) / len((" " + doc["answer"]).encode("utf-8"))}


def niah_single_1(**kwargs):
    from quantmla.evaluation.lm_eval.niah import niah_dataset

    return niah_dataset("niah_single_1", **kwargs)


def niah_single_2(**kwargs):
    from quantmla.evaluation.lm_eval.niah import niah_dataset

    return niah_dataset("niah_single_2", **kwargs)


def niah_single_3(**kwargs):
    from quantmla.evaluation.lm_eval.niah import niah_dataset

    return niah_dataset("niah_single_3", **kwargs)


def ruler_aggregate(values: list[float]) -> float:
    """RULER's per-length mean (-1 marks a sample of another length): upstream's own function."""
    from lm_eval.tasks.ruler.common_utils import aggregate_metrics

    return aggregate_metrics(values)
