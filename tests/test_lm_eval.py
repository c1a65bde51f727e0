"""The lm-eval suites and RULER: local tasks build upstream's prompts, score documents on the tiny
model and reach the store; RULER samples are deterministic, sized and hold one needle; bad input
stops before anything loads."""

import ast
import json
import math
from pathlib import Path

import pytest

from quantmla.errors import ConfigError, DataNotFoundError
from quantmla.evaluation.lm_eval import niah
from quantmla.evaluation.lm_eval.suites import TASKS, TASKS_DIR
from quantmla.evaluation.lm_eval.tasks import local_docs
from tests.conftest import DATA_DIR, TINY_MLA, needs_tiny, run_config

pytestmark = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data")


@pytest.fixture(scope="module")
def manager():
    from quantmla.evaluation.lm_eval.runner import task_manager

    return task_manager({"data_dir": str(DATA_DIR)})


def requests(manager, spec, limit=None, only=None) -> dict[str, list[tuple]]:
    """Every request lm-eval would send to the model, per task (or for task `only`)."""
    out = {}
    for name, task in manager.load([spec])["tasks"].items():
        if only not in (None, name):
            continue
        task.set_fewshot_seed(seed=1234)  # what simple_evaluate does (our evaluator's seed)
        task.build_all_requests(limit=limit)
        out[name] = [inst.arguments for inst in task.instances]
    return out


def upstream_with(task: str, docs, **overrides):
    """lm-eval's own task `task`, unchanged but for its documents (given in upstream's fields) and
    `overrides` the suite states too (splits the data does not have, MMLU's 5 shots)."""
    return {
        "group": f"upstream_{task}",
        "task": [{"task": task, "custom_dataset": docs, **overrides}],
    }


def _jsonl(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def test_piqa_local_prompts_equal_upstream_prompts(manager):
    folder = DATA_DIR / "piqa"
    labels = (folder / "valid-labels.lst").read_text().split()
    rows = [{**d, "label": int(y)} for d, y in zip(_jsonl(folder / "valid.jsonl"), labels)]
    upstream = requests(
        manager,
        upstream_with("piqa", lambda **_: local_docs._splits(validation=rows), training_split=None),
    )
    local = requests(manager, "quantmla_piqa")
    assert len(local["piqa"]) == 2 * 1838
    assert local == upstream


def test_gsm8k_local_prompts_equal_upstream_prompts_with_5_shots(manager):
    folder = DATA_DIR / "gsm8k"
    docs = lambda **_: local_docs._splits(  # noqa: E731
        train=_jsonl(folder / "train.jsonl"), test=_jsonl(folder / "test.jsonl")
    )
    upstream = requests(manager, upstream_with("gsm8k", docs), limit=6)
    local = requests(manager, "quantmla_gsm8k", limit=6)
    assert local == upstream
    context = local["gsm8k"][0][0]
    assert context.count("Question:") == 6  # 5 exemplars + the question


def gsm8k_reference_prompt(doc: dict) -> str:
    """GSM8K's 5-shot prompt in upstream's format with the first 5 train examples (built here)."""
    shots = _jsonl(DATA_DIR / "gsm8k" / "train.jsonl")[:5]
    examples = "".join(f"Question: {d['question']}\nAnswer: {d['answer']}\n\n" for d in shots)
    return examples + f"Question: {doc['question']}\nAnswer:"


def test_gsm8k_reference_scores_each_solution_after_the_first_5_train_examples(manager):
    test = _jsonl(DATA_DIR / "gsm8k" / "test.jsonl")[:3]
    local = requests(manager, "quantmla_gsm8k_reference_local", limit=3)
    assert local["quantmla_gsm8k_reference"] == [
        (gsm8k_reference_prompt(d), " " + d["answer"]) for d in test
    ]
    doc = {"answer": "é 4"}  # 4 UTF-8 bytes after the delimiter's space
    bpb = local_docs.reference_bits_per_byte(doc, [(-2 * math.log(2), False)])
    assert bpb == {"bpb": pytest.approx(2 / 5)}


def test_gsm8k_reference_drawn_prompts_are_upstream_gsm8ks_each_with_its_own_shots(manager):
    """The drawn variant's contexts are upstream gsm8k's 5-shot prompts (its seeded sampler), each
    continued by the document's reference solution; the documents' shots differ."""
    folder = DATA_DIR / "gsm8k"
    docs = lambda **_: local_docs._splits(  # noqa: E731
        train=_jsonl(folder / "train.jsonl"), test=_jsonl(folder / "test.jsonl")
    )
    upstream = requests(manager, upstream_with("gsm8k", docs), limit=4)["gsm8k"]
    drawn = requests(manager, "quantmla_gsm8k_reference_drawn_local", limit=4)
    test = _jsonl(folder / "test.jsonl")[:4]
    pairs = drawn["quantmla_gsm8k_reference_drawn"]
    assert [context for context, _ in pairs] == [context for context, _ in upstream]
    assert [answer for _, answer in pairs] == [" " + d["answer"] for d in test]
    assert len({context.split("\nAnswer:")[0] for context, _ in pairs}) == 4  # first shots differ
    assert all(context.count("Question:") == 6 for context, _ in pairs)


def test_mmlu_converted_files_build_the_original_format_prompts(manager):
    """The converted CSVs (what the local task reads) and hendrycks' original CSVs, through
    upstream's mmlu_high_school_chemistry: identical 5-shot prompts for all 203 questions."""
    subject = "high_school_chemistry"
    original = DATA_DIR / "mmlu" / "original_format_subset"
    files = {p.name: p for p in original.rglob("*.csv")}
    docs = lambda **_: local_docs._splits(  # noqa: E731
        test=local_docs.mmlu_rows_original(files[f"{subject}_test.csv"], subject),
        dev=local_docs.mmlu_rows_original(files[f"{subject}_dev.csv"], subject),
    )
    upstream = requests(manager, upstream_with(f"mmlu_{subject}", docs, num_fewshot=5))
    local = requests(manager, "quantmla_mmlu", only=f"mmlu_{subject}")
    assert len(local[f"mmlu_{subject}"]) == 4 * 203
    assert local == upstream
    assert local[f"mmlu_{subject}"][0][0].count("\nAnswer:") == 6


def test_local_mmlu_group_lists_every_upstream_subject(manager):
    upstream = sorted(
        n
        for n in manager.all_subtasks
        if n.startswith("mmlu_")
        and (Path(manager.task_index[n].yaml_path).parent.name == "default")
    )
    text = (TASKS_DIR / "quantmla_mmlu.yaml").read_text()
    assert len(upstream) == 57
    assert (
        sorted(
            line.split("task: ")[1].split(",")[0]
            for line in text.splitlines()
            if "{task: mmlu_" in line
        )
        == upstream
    )


def test_arc_llm_foundry_file_builds_the_original_format_prompts(manager):
    """ARC-Challenge: llm-foundry's copy (read by the local task) vs AI2's original jsonl (1,150
    of 1,172 questions), both through upstream's arc_challenge: identical requests per question."""
    original = local_docs.arc_rows_original(
        DATA_DIR / "arc" / "original_format_partial" / "ARC-Challenge-Test.jsonl"
    )
    local_rows = local_docs.arc_rows_llm_foundry(
        DATA_DIR / "arc" / "llm-foundry_icl" / "arc_challenge_test.jsonl"
    )
    upstream = requests(
        manager,
        upstream_with(
            "arc_challenge",
            lambda **_: local_docs._splits(test=original),
            training_split=None,
            validation_split=None,
        ),
    )
    local = requests(manager, "quantmla_arc_challenge")

    def by_question(reqs, rows):
        grouped, i = {}, 0
        for row in rows:
            n = len(row["choices"]["text"])
            grouped.setdefault(row["question"], []).append(reqs[i : i + n])
            i += n
        return grouped

    up = by_question(upstream["arc_challenge"], original)
    lo = by_question(local["arc_challenge"], local_rows)
    unique = [q for q in up if len(up[q]) == 1 and len(lo.get(q, [])) == 1]
    four = [q for q in unique if len(up[q][0]) == 4]
    assert len(unique) >= 1140
    assert all(up[q] == lo[q] for q in four)
    # llm-foundry always has 4 choices: 3-choice questions gain a duplicate, 5-choice lose one
    assert len(unique) - len(four) == 6 and all(up[q] != lo[q] for q in unique if q not in four)


def test_winogrande_and_hellaswag_local_requests(manager):
    """Formats that cannot be compared with upstream's fields: the requests are what docs/evaluation.md
    says — WinoGrande partial scoring on llm-foundry's split sentence, HellaSwag upstream's
    preprocessing of llama.cpp's `label: context` line."""
    wino = requests(manager, "quantmla_winogrande", limit=2)["winogrande"]
    first = _jsonl(DATA_DIR / "winogrande" / "llm-foundry_icl" / "winogrande_dev.jsonl")[0]
    assert wino[:2] == [(opt, " " + first["continuation"]) for opt in first["context_options"]]
    hella = requests(manager, "quantmla_hellaswag", limit=1)["hellaswag"]
    lines = (DATA_DIR / "hellaswag" / "hellaswag_val_full.txt").read_text().split("\n")[:6]
    assert [r[0] for r in hella] == [lines[0]] * 4
    assert [r[1] for r in hella] == [" " + e for e in lines[2:6]]


def test_every_suite_task_names_an_upstream_task(manager):
    for task in TASKS.values():
        if task.upstream.startswith("quantmla_"):
            continue
        assert task.upstream in manager.all_tasks, task.name
        if task.local:
            assert task.local in manager.all_tasks


@needs_tiny
def test_local_tasks_score_4_documents_on_the_tiny_model_and_reach_the_store(tmp_path, monkeypatch):
    """A job killed inside lm-eval (after its 5th answer) leaves no record; the rerun answers only
    the requests not answered yet and writes it: every local task but MMLU (next test; all 57
    subjects: -m slow) scored on 4 documents, metrics (prompt lengths of every request) in the
    record, the saved answers gone."""
    from lm_eval.api.model import CacheHook, hash_args

    from quantmla.run import run
    from quantmla.tracking.store import load_records

    overrides = [
        f"paths.results_dir={tmp_path}",
        f"paths.data_dir={DATA_DIR}",
        "model=tiny_mla",
        "eval=table1_suite",
        "eval.tasks=[hellaswag,piqa,arc_easy,arc_challenge,winogrande,gsm8k]",
        "eval.limit=4",
        "eval.max_gen_toks=16",
        "logger=none",
    ]

    save, answered = CacheHook.add_partial, [[], []]  # each run's answered requests

    def add_partial(self, attr, request, result):  # lm-eval saves each answer here
        save(self, attr, request, result)
        answered[-1].append(hash_args(attr, request))
        if answered[0] is answered[-1] and len(answered[0]) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(CacheHook, "add_partial", add_partial)
    answered.pop()
    with pytest.raises(KeyboardInterrupt):
        run(run_config(*overrides))
    assert not list(tmp_path.rglob("result.json"))
    assert [p.name for p in tmp_path.rglob("progress-*")] == ["progress-lm_eval_rank0.db"]
    answered.append([])
    record = run(run_config(*overrides))
    m = record["metrics"]
    assert m["resumed/lm_eval_answers"] == 5 and not set(answered[0]) & set(answered[1])
    assert len(answered[1]) > 5 * len(record["config"]["eval"]["tasks"])
    assert not list(tmp_path.rglob("progress-*"))
    for name in ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "gsm8k"):
        assert m[f"n/{name}"] == 4
        assert 0 <= m[f"acc/{name}"] <= 100
        assert f"acc_stderr/{name}" in m
        docs = m[f"docs/{name}"]  # per document, for paired comparisons: their mean is the score
        assert len(docs) == 4 and 100 * sum(docs) / 4 == pytest.approx(m[f"acc/{name}"])
    assert m["acc/avg"] == pytest.approx(
        sum(m[f"acc/{n}"] for n in record["config"]["eval"]["tasks"]) / 6
    )
    for name in ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande"):  # log-likelihood
        assert m[f"tokens_median/{name}"] > 1 and 0 <= m[f"beyond_protected/{name}"] <= 100
    assert "tokens_median/gsm8k" not in m  # generated: no log-likelihood requests
    assert [r["metrics"]["acc/avg"] for r in load_records(tmp_path)] == [m["acc/avg"]]


@needs_tiny
def test_gsm8k_reference_job_records_float64_bits_per_byte_per_document(tmp_path):
    """The job's per-document bits per byte are each reference solution's, computed here in
    float64 from the model's logits (no lm-eval); the column is their mean, not a rate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.run import run

    overrides = [
        f"paths.results_dir={tmp_path}",
        f"paths.data_dir={DATA_DIR}",
        "model=tiny_mla",
        "eval=table1_suite",
        "precision=bf16",
        "eval.tasks=[gsm8k_reference]",
        "eval.limit=2",
        "logger=none",
    ]
    m = run(run_config(*overrides))["metrics"]
    model = AutoModelForCausalLM.from_pretrained(TINY_MLA, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MLA)
    expected = []
    for doc in _jsonl(DATA_DIR / "gsm8k" / "test.jsonl")[:2]:
        context, answer = gsm8k_reference_prompt(doc), " " + doc["answer"]
        n = len(tokenizer(context).input_ids)  # lm-eval's default: the tokenizer's BOS, if any
        ids = tokenizer(context + answer).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        logprobs = torch.log_softmax(logits[n - 1 : -1], dim=-1)
        nats = logprobs.gather(1, torch.tensor(ids[n:])[:, None]).sum().item()
        expected.append(-nats / math.log(2) / len(answer.encode("utf-8")))
    assert m["docs/gsm8k_reference"] == pytest.approx(expected, rel=1e-4)
    assert m["acc/gsm8k_reference"] == pytest.approx(sum(expected) / 2, rel=1e-4)
    assert m["n/gsm8k_reference"] == 2 and "acc/avg" not in m  # bits per byte: not a rate


@needs_tiny
def test_local_mmlu_subject_scores_4_documents_5_shot_on_the_tiny_model(manager):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_MLA)
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(TINY_MLA), device="cpu")
    spec = {
        "group": "one_subject",
        "task": [
            {
                "task": "mmlu_anatomy",
                "custom_dataset": local_docs.mmlu,
                "dataset_kwargs": {"subject": "anatomy"},
                "num_fewshot": 5,
            }
        ],
    }
    out = simple_evaluate(model=lm, tasks=[spec], limit=4, task_manager=manager, log_samples=False)
    assert out["n-samples"]["mmlu_anatomy"]["effective"] == 4
    assert out["results"]["mmlu_anatomy"]["acc,none"] in (0, 0.25, 0.5, 0.75, 1)


@pytest.mark.slow
@needs_tiny
def test_table1_local_suite_with_all_mmlu_subjects_on_the_tiny_model(tmp_path):
    from quantmla.run import run

    record = run(
        run_config(
            f"paths.results_dir={tmp_path}",
            f"paths.data_dir={DATA_DIR}",
            "model=tiny_mla",
            "eval=table1_suite",
            "eval.tasks=[hellaswag,piqa,arc_easy,arc_challenge,winogrande,mmlu,gsm8k]",
            "eval.limit=4",
            "eval.max_gen_toks=16",
            "logger=none",
        )
    )
    assert record["metrics"]["n/mmlu"] == 4 * 57  # lm-eval's limit is per subject
    assert (
        len(record["metrics"]["docs/mmlu"]) == 4 * 57
    )  # the group's documents, subject by subject


# --------------------------------------------------------------------------------------- RULER


def _upstream_source(name: str) -> str:
    import lm_eval

    return (Path(lm_eval.__file__).parent / "tasks" / "ruler" / name).read_text()


def _constant(source: str, name: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise KeyError(name)


def test_niah_template_needle_and_haystack_are_rulers():
    assert _constant(_upstream_source("niah_utils.py"), "TEMPLATE") == niah.TEMPLATE
    prepare = _upstream_source("prepare_niah.py")
    assert _constant(prepare, "NEEDLE") == niah.NEEDLE
    assert f'haystack = "{niah.REPEAT_HAYSTACK}"' in prepare


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MLA)


@needs_tiny
@pytest.mark.parametrize("variant", sorted(niah.VARIANTS))
def test_niah_samples_are_deterministic_sized_and_hold_one_needle(variant, tokenizer):
    for length in (512, 2048):
        samples = niah.generate(variant, length, tokenizer, DATA_DIR, 4, seed=7)
        assert samples == niah.generate(variant, length, tokenizer, DATA_DIR, 4, seed=7)
        assert samples != niah.generate(variant, length, tokenizer, DATA_DIR, 4, seed=8)
        for s in samples:
            tokens = len(tokenizer(niah.prompt_text(s)).input_ids) + 128
            assert s["length"] == tokens and 0.98 * length <= tokens <= length
            assert s["input"].count(s["needle"]) == 1
            assert s["input"].count(s["outputs"][0]) == 1
            assert s["gen_prefix"].endswith("mentioned in the provided text is")


def test_niah_needle_depths_cover_the_haystack(tokenizer):
    words = niah.haystack_words("essay", 3000, DATA_DIR)
    positions = []
    for depth in (0, 50, 100):
        text = niah.insert_needle(words, "NEEDLE.", depth)
        positions.append(text.index("NEEDLE.") / len(text))
    assert positions[0] == 0 and 0.4 < positions[1] < 0.6 and positions[2] > 0.99


@needs_tiny
def test_ruler_job_scores_each_task_and_length_into_the_record(tmp_path, capsys):
    from quantmla.run import run

    record = run(
        run_config(
            f"paths.results_dir={tmp_path}",
            f"paths.data_dir={DATA_DIR}",
            "model=tiny_mla",
            "eval=ruler",
            "eval.context_lengths=[512,1024]",
            "eval.limit=1",
            "eval.max_gen_toks=4",
            "logger=none",
        )
    )
    m = record["metrics"]
    assert m["ruler/samples_per_length"] == 1
    for task in ("s_niah_1", "s_niah_2", "s_niah_3"):
        for length in (512, 1024):
            assert m[f"ruler/{task}/{length}"] in (0.0, 100.0)
            # each sample's score, of that length only: their mean is lm-eval's
            scores = m[f"docs/ruler/{task}/{length}"]
            assert [100 * d for d in scores] == [m[f"ruler/{task}/{length}"]]
        assert m[f"ruler/{task}/avg"] == (m[f"ruler/{task}/512"] + m[f"ruler/{task}/1024"]) / 2
    assert "punkt" not in capsys.readouterr().out


# ----------------------------------------------------------------------------------- bad input


def _validate(*overrides):
    from quantmla.job import resolve as validate

    return validate(run_config("model=tiny_mla", "logger=none", *overrides))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["eval=table1_suite", "eval.tasks=[hellaswag,mmlux]"], "eval.tasks.*mmlux.*hellaswag"),
        (["eval=table1_suite", "eval.limit=0"], "eval.limit"),
        (["eval=table1_suite", "eval.data=disk"], "eval.data.*local"),
        (["eval=ruler", "eval.context_lengths=[4096]"], "max_position_embeddings \\(2048\\)"),
        (["eval=ruler", "eval.context_lengths=[3000]"], "eval.context_lengths.*3000"),
        (["eval=ruler", "eval.tasks=[s_niah_4]"], "s_niah_4.*s_niah_1"),
        (["eval=table2_suite", "eval.tasks=[humaneval]"], "HF_ALLOW_CODE_EVAL=1"),
        (["eval=table1_suite", "eval.tasks=[piqa]", "cache.backend=packed"], "eval.batch_size"),
    ],
)
def test_bad_suite_input_is_one_line_before_anything_loads(overrides, match, monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(ConfigError, match=match) as info:
        _validate(f"paths.data_dir={DATA_DIR}", *overrides)
    assert "\n" not in str(info.value)


def test_hub_only_task_offline_and_missing_essays_stop_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DataNotFoundError, match="'fda' reads hazyresearch/based-fda") as info:
        _validate(f"paths.data_dir={DATA_DIR}", "eval=table1_suite")
    assert "\n" not in str(info.value)
    with pytest.raises(DataNotFoundError, match="hellaswag.*eval.data=local"):
        _validate(
            f"paths.data_dir={DATA_DIR}",
            "eval=table1_suite",
            "eval.tasks=[hellaswag]",
            "eval.data=hub",
        )
    empty = tmp_path / "data"
    (empty / "niah-paul-graham-essays" / "PaulGrahamEssays").mkdir(parents=True)
    with pytest.raises(DataNotFoundError, match="no essays"):
        _validate(f"paths.data_dir={empty}", "eval=ruler", "eval.context_lengths=[512]")
    _validate(f"paths.data_dir={DATA_DIR}", "eval=table1_suite", "eval.tasks=[hellaswag,mmlu]")


# ------------------------------------------------------------------- code execution (sandboxed)

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
STDIN_TESTS = json.dumps(
    [
        {"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
        {"input": "40 2\n", "output": "42", "testtype": "stdin"},
    ]
)


def _compressed(tests: list) -> str:
    import base64
    import pickle
    import zlib

    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


@pytest.fixture
def code_eval(monkeypatch):
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    from quantmla.evaluation.lm_eval import sandbox

    return sandbox


def test_code_never_runs_without_the_opt_in(monkeypatch, tmp_path):
    from quantmla.evaluation.lm_eval import sandbox

    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    marker = tmp_path / "ran"
    with pytest.raises(sandbox.CodeExecutionNotAllowed, match="HF_ALLOW_CODE_EVAL=1"):
        sandbox.run_tests(f"open({str(marker)!r}, 'w')", STDIN_TESTS)
    assert not marker.exists()


def test_sandbox_passes_right_programs_and_fails_wrong_ones(code_eval):
    assert code_eval.run_tests(ADD, STDIN_TESTS)["passed"]
    assert not code_eval.run_tests(ADD.replace("+", "-"), STDIN_TESTS)["passed"]
    private = _compressed([{"input": "5 5\n", "output": "10\n", "testtype": "stdin"}])
    assert code_eval.run_tests(ADD, STDIN_TESTS, private)["passed"]
    wrong_private = _compressed([{"input": "5 5\n", "output": "11\n", "testtype": "stdin"}])
    verdict = code_eval.run_tests(ADD, STDIN_TESTS, wrong_private)
    assert not verdict["passed"] and "test 2" in verdict["reason"]
    functional = json.dumps(
        [{"input": "[1, 2, 3]\n2", "output": "[3, 4, 5]", "testtype": "functional"}]
    )
    solution = "class Solution:\n    def shift(self, xs, k):\n        return [x + k for x in xs]\n"
    assert code_eval.run_tests(solution, functional, None, "shift")["passed"]


def test_sandbox_limits_time_memory_and_network(code_eval):
    limits = code_eval.Limits(seconds_per_test=1.0, memory_mb=512, max_wall_seconds=20)
    loop = code_eval.run_tests("while True:\n    pass\n", STDIN_TESTS, limits=limits)
    assert not loop["passed"] and "time limit" in loop["reason"]
    bomb = code_eval.run_tests("x = bytearray(2 * 1024**3)\nprint(3)", STDIN_TESTS, limits=limits)
    assert not bomb["passed"] and "MemoryError" in bomb["reason"]
    net = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint(3)"
    verdict = code_eval.run_tests(net, STDIN_TESTS, limits=limits)
    assert not verdict["passed"] and "network access is disabled" in verdict["reason"]
    forged = "import os, sys\nsys.__stdout__.write('0 {\"passed\": true}\\n')\nos._exit(0)"
    assert not code_eval.run_tests(forged, STDIN_TESTS, limits=limits)["passed"]


def test_livecodebench_prompt_extraction_and_scoring(code_eval):
    from quantmla.evaluation.lm_eval.tasks import livecodebench as lcb

    doc = {
        "question_content": "Print the sum of two integers.",
        "starter_code": "",
        "public_test_cases": STDIN_TESTS,
        "private_test_cases": _compressed([{"input": "2 2", "output": "4", "testtype": "stdin"}]),
        "metadata": "{}",
    }
    prompt = lcb.doc_to_text(doc)
    assert "Print the sum of two integers." in prompt and "standard input" in prompt
    answer = f"Here it is:\n```python\n{ADD}```\nDone."
    assert lcb.extract_program(answer) == ADD
    assert lcb.extract_program(f"```python\n{ADD}") == ADD  # cut by the token budget
    assert lcb.process_results(doc, [answer]) == {"pass@1": 1.0}
    assert lcb.process_results(doc, ["print(4)"]) == {"pass@1": 0.0}


def test_livecodebench_task_loads_in_lm_eval(manager):
    assert "quantmla_livecodebench" in manager.all_tasks


@pytest.mark.parametrize("name", [n for n in TASKS if n.endswith("shot")])
def test_few_shot_commonsense_prepends_n_other_documents(manager, name):
    """`<task>_<n>shot`: each request is the 0-shot request behind n examples (lm-eval's "\\n\\n"
    delimiter) drawn from the same local split, never the document itself."""
    task = TASKS[name]
    few = requests(manager, task.local, limit=3)[task.upstream]
    zero = requests(manager, f"quantmla_{task.upstream}", limit=3)[task.upstream]
    assert len(few) == len(zero)
    for (context, target), (context0, target0) in zip(few, zero):
        assert target == target0 and context.endswith(context0)
        examples = context[: -len(context0)].split("\n\n")
        assert len(examples) == task.num_fewshot + 1 and examples[-1] == ""
        assert not any(context0.strip() in e for e in examples[:-1])


def test_one_shot_count_per_upstream_task_in_a_job():
    from types import SimpleNamespace

    from quantmla.evaluation.lm_eval.suites import check_lm_eval

    ev = SimpleNamespace(
        kind="lm_eval", data="local", limit=4, tasks=["hellaswag", "hellaswag_10shot"]
    )
    with pytest.raises(ConfigError, match="one shot count per upstream task"):
        check_lm_eval(ev, None, DATA_DIR)
