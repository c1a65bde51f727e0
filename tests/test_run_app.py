"""The Hydra app end to end on the tiny model: every config option composes, jobs run, record, skip."""

import json

import pytest

from quantmla.run import run
from tests.conftest import REPO, compose_run, needs_tiny, run_config, tiny_job

GROUPS = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and any(p.glob("*.yaml")))
OPTIONS = [
    (group, p.stem)
    for group in GROUPS
    for p in sorted((REPO / "conf" / group).glob("*.yaml"))
    if group not in ("experiment", "local")
]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes(group, option):
    cfg = compose_run(f"{group}={option}")
    assert group in cfg


@needs_tiny
def test_default_run_writes_a_record_and_resumes(tmp_path, capsys):
    overrides = [f"paths.results_dir={tmp_path}", "eval.max_windows=2", "logger=none"]
    record = run(run_config(*overrides))
    path = next(tmp_path.glob("default/*/result.json"))
    stored = json.loads(path.read_text())
    assert stored == json.loads(json.dumps(record, default=str))
    assert {"config", "metrics", "git_sha", "versions", "created"} <= stored.keys()
    # the job's own CPU time, not the process's since it started: at most every core's wall time
    assert 0 < stored["cpu_time_s"] <= stored["wall_time_s"] * stored["machine"]["cpus"] + 0.5
    metrics = stored["metrics"]
    assert (
        metrics["ppl/wikitext2"] >= metrics["bf16/ppl/wikitext2"] * 0.999
        and metrics["windows/wikitext2"] == 2
    )
    out = capsys.readouterr().out
    assert (
        "| c4r4 | rtn |" in out and "eval=perplexity" in out
    )  # preview says how to run the full one
    again = run(run_config(*overrides))  # same config: skipped, the record is returned unchanged
    assert again["created"] == stored["created"] and "skipped" in capsys.readouterr().out


@needs_tiny
def test_perplexity_job_stopped_mid_way_resumes_and_ends_as_an_uninterrupted_one(
    tmp_path, monkeypatch, capsys
):
    """Stopped after 3 of its batches were saved, the rerun measures only the windows left (same
    batches) and writes the uninterrupted run's per-window NLLs exactly; the progress goes with
    the record."""
    from quantmla.tracking.store import Progress

    overrides = ["eval.max_windows=5", "eval.batch_size=2", "eval.datasets=[wikitext2,c4]"]
    whole = run(run_config(*tiny_job(tmp_path / "whole", *overrides)))
    keep, saves = Progress.save, []

    def save(self, key, values):  # after each batch
        keep(self, key, values)
        saves.append(len(values))
        if stop and len(saves) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "save", save)
    stop, stopped = True, tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run(run_config(*tiny_job(stopped, *overrides)))
    assert saves == [2, 4, 5]  # wikitext2's 5 windows in batches of 2 saved, then stopped
    saves.clear()
    stop = False
    resumed = run(run_config(*tiny_job(stopped, *overrides)))
    assert saves == [2, 4, 5] and "resuming" in capsys.readouterr().out  # c4 alone
    assert not list(stopped.rglob("progress-*"))
    assert resumed["metrics"]["resumed/windows/wikitext2"] == 5  # the costs table says so
    for key in ("nll_windows/wikitext2", "nll_windows/c4", "ppl/wikitext2", "ppl/c4"):
        assert resumed["metrics"][key] == whole["metrics"][key], key


@needs_tiny
def test_precision_without_preset_is_a_job(tmp_path):
    from quantmla.cli import route_precision

    overrides = route_precision(tiny_job(tmp_path, "precision=c3r8"))
    record = run(run_config(*overrides))
    assert (
        record["config"]["precision"]["name"] == "c3r8" and record["metrics"]["ppl/wikitext2"] > 1
    )


@needs_tiny
def test_gsm8k_perplexity_is_the_models_loss_on_its_questions_and_answers(tmp_path):
    """eval.datasets=[gsm8k]: the BF16 window NLL equals transformers' float64 loss on the first
    window of the test set's "Question: …\\nAnswer: …" documents joined by blank lines (built here
    from the file)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import DATA_DIR, TINY_MLA

    job = tiny_job(tmp_path, "eval.datasets=[gsm8k]", "+eval.splits.gsm8k=test", "precision=bf16")
    metrics = run(run_config(*job))["metrics"]
    lines = (DATA_DIR / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line) for line in lines if line]
    text = "\n\n".join(f"Question: {d['question']}\nAnswer: {d['answer']}" for d in docs)
    ids = AutoTokenizer.from_pretrained(TINY_MLA)(text, add_special_tokens=False).input_ids
    window = torch.tensor(ids[:512])
    model = AutoModelForCausalLM.from_pretrained(TINY_MLA, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(window[None]).logits[0]
    expected = float(F.cross_entropy(logits[:-1], window[1:]))
    assert metrics["windows/gsm8k"] == 1
    assert metrics["nll_windows/gsm8k"][0] == pytest.approx(expected, rel=1e-5)
