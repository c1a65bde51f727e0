"""eval.kind=lm_eval: the Table 1 / Table 2 suites on lm-eval's own machinery.

`lm_eval.simple_evaluate` runs lm-eval's tasks (or the project's local-document variants of them)
on `HFLM` wrapping the already prepared model: patched cache, fused transforms, checked
equivalence. With `eval.engine=vllm` the prepared model is exported instead and lm-eval's own
`vllm` model type runs it with the QuantMLA backend in the serving venv
(`vllm_worker`), the way evaluations run at scale. Nothing here scores
anything itself."""

from __future__ import annotations

import logging

from quantmla.evaluation.lm_eval.samples import document_scores
from quantmla.evaluation.lm_eval.suites import TASKS, TASKS_DIR, data_mode
from quantmla.tracking.store import LM_EVAL_RESULTS


def task_manager(metadata: dict):
    """lm-eval's index of its own tasks plus the project's (quantmla/evaluation/lm_eval/tasks);
    `metadata` reaches every task's `custom_dataset` (e.g. data_dir)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), metadata=metadata)


def wrap_model(cfg, prepared, max_length: int | None = None):
    from lm_eval.models.huggingface import HFLM

    from quantmla.evaluation.lm_eval.prefix_cache import PrefixCachedHFLM

    return (PrefixCachedHFLM if cfg.eval.prefix_cache else HFLM)(
        pretrained=prepared.model,
        tokenizer=prepared.tokenizer,
        batch_size=cfg.eval.batch_size,
        max_length=max_length,
        device=str(next(prepared.model.parameters()).device),
        enable_thinking=False if cfg.eval.apply_chat_template else None,
    )


ENGINES = ("hf", "vllm")


def answered_requests(prepared) -> str | None:
    """lm-eval's request cache for this job (`simple_evaluate(use_cache=...)`): each answer is saved
    as it comes, so a job stopped mid-way resumes with the requests it had not answered; the file
    lives beside the record until the record is written (`quantmla.tracking.store.progress_path`)."""
    from quantmla.tracking.store import progress_path

    if prepared.record_path is None:
        return None
    path = progress_path(prepared.record_path, "lm_eval")
    saved = path.with_name(path.name + "_rank0.db")  # lm-eval's name for rank 0's cache
    if saved.exists():
        from sqlitedict import SqliteDict

        with SqliteDict(str(saved), flag="r") as answers:
            n = prepared.metrics["resumed/lm_eval_answers"] = len(answers)
        print(f"[quantmla] resuming: {n} lm-eval answers saved in {saved}")
    return str(path)


def run_on_vllm(cfg, prepared, specs, metadata, limit=None, max_length=None) -> dict:
    """The same `simple_evaluate` call through lm-eval's `vllm` model on the job's export."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from quantmla.checkpoint import write_checkpoint
    from quantmla.errors import QuantMLAError

    ev, paths = cfg.eval, prepared.paths
    paths.artifacts_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=paths.artifacts_dir, prefix="lm-eval-vllm-") as tmp:
        folder = Path(tmp)
        export = write_checkpoint(cfg, prepared, folder / "export")
        request = {
            "model": str(export),
            "engine": {
                "precision": None if prepared.policy.spec.quantized else "bf16",
                "max_model_len": max_length,
                "dtype": str(cfg.model.dtype),
                "seed": cfg.seed,
            },
            "tasks": specs,
            "limit": limit,
            "include_path": str(TASKS_DIR),
            "metadata": metadata,
            "gen_kwargs": {"max_gen_toks": ev.max_gen_toks} if ev.max_gen_toks else None,
            "apply_chat_template": ev.apply_chat_template,
            "confirm_run_unsafe_code": any(TASKS[t].code for t in ev.tasks if t in TASKS),
            "seed": cfg.seed,
            "use_cache": answered_requests(prepared),
        }
        (folder / "request.json").write_text(json.dumps(request))
        command = [
            str(paths.serve_python), "-m", "quantmla.evaluation.lm_eval.vllm_worker",
            str(folder / "request.json"), str(folder / "results.json"),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=paths.root, stdout=sys.stdout, stderr=sys.stderr)
        if done.returncode:
            raise QuantMLAError(f"lm-eval on vLLM failed (exit {done.returncode})")
        return json.loads((folder / "results.json").read_text())


def run_lm_eval(cfg, prepared, specs: list[str], metadata: dict, limit=None, max_length=None):
    """One `simple_evaluate` call; returns lm-eval's results dict."""
    if cfg.eval.engine == "vllm":
        return run_on_vllm(cfg, prepared, specs, metadata, limit, max_length)
    import datasets
    from lm_eval import simple_evaluate

    datasets.disable_progress_bars()  # document mapping; lm-eval's own bars show the work
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    logging.getLogger("lm_eval.api.task").setLevel(
        logging.ERROR
    )  # a custom_dataset notice per task
    ev = cfg.eval
    lm = wrap_model(cfg, prepared, max_length)
    results = simple_evaluate(
        model=lm,
        tasks=specs,
        limit=limit,
        task_manager=task_manager(metadata),
        gen_kwargs={"max_gen_toks": ev.max_gen_toks} if ev.max_gen_toks else None,
        apply_chat_template=ev.apply_chat_template,
        log_samples=True,  # per-document scores (paired comparisons); W&B's sample tables
        bootstrap_iters=1000,
        confirm_run_unsafe_code=any(TASKS[t].code for t in ev.tasks if t in TASKS),
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=1234,  # lm-eval's default: identical few-shot draws across methods
        use_cache=answered_requests(prepared),
    )
    results[REQUEST_TOKENS] = request_lengths(lm, results.get("samples") or {})
    return results


REQUEST_TOKENS = "quantmla/request_tokens"  # per lm-eval task: each log-likelihood request's tokens


def request_lengths(lm, samples: dict) -> dict[str, list[int]]:
    """Each log-likelihood request's input tokens per task, encoded as HFLM encodes it and capped
    at its window, from lm-eval's logged samples (the arguments of every request, answered now or
    read back from the request cache)."""
    lengths: dict[str, list[int]] = {}
    for task, examples in samples.items():
        for example in examples:
            for args in example.get("arguments", ()):
                if (
                    example.get("filter", "none") != "none"
                    or len(args) != 2
                    or not isinstance(args[1], str)
                ):
                    continue  # generation (context, kwargs), rolling, or a later filter's copy
                context, continuation = args
                if context:
                    context_enc, continuation_enc = lm._encode_pair(context, continuation)
                    tokens = len(context_enc) + len(continuation_enc)
                else:  # HFLM's empty context: the prefix token first unless the text starts with it
                    encoded = lm.tok_encode(continuation, add_special_tokens=False)
                    tokens = len(encoded) + (encoded[:1] != [lm.prefix_token_id])
                lengths.setdefault(task, []).append(min(tokens - 1, lm.max_length))
    return lengths


def prompt_metrics(names: list[str], lengths: dict[str, list[int]], protected: int) -> dict:
    """`tokens_median/<task>` and `beyond_protected/<task>` (% of the task's log-likelihood
    requests with more input tokens than the `protected` sink + recent: quantized, their scores
    read dequantized keys) over lm-eval task `names` (a group's subtasks); {} without requests."""
    import statistics

    tokens = [n for name in names for n in lengths.get(name, [])]
    if not tokens:
        return {}
    return {
        "tokens_median": float(statistics.median(tokens)),
        "beyond_protected": 100 * sum(n > protected for n in tokens) / len(tokens),
    }


def logs_to_wandb(cfg) -> bool:
    return getattr(getattr(cfg, "logger", None), "name", "none") == "wandb"


def attach_results(cfg, metrics: dict, results: dict) -> dict:
    """lm-eval's own results beside the metrics, for lm-eval's W&B logger; `run` takes them out
    before the record is written (the store keeps only the metrics)."""
    if logs_to_wandb(cfg):
        metrics[LM_EVAL_RESULTS] = results
    return metrics


def _number(value):
    return float(value) if isinstance(value, (int, float)) else None


def _members(task: str, groups: dict[str, list[str]]) -> list[str]:
    """A task's name, or a group's and every task under it (nested groups: upstream MMLU)."""
    return [task, *(name for sub in groups.get(task, []) for name in _members(sub, groups))]


def evaluate(cfg, prepared) -> dict:
    """acc/<task> (the paper's metric, in % for rates), acc_stderr/<task>, n/<task>, and acc/avg
    (the rates' mean)."""
    import lm_eval

    ev = cfg.eval
    tasks = [TASKS[name] for name in ev.tasks]
    data = data_mode(ev, prepared.paths.data_dir)
    results = run_lm_eval(
        cfg,
        prepared,
        [t.spec(data) for t in tasks],
        {"data_dir": str(prepared.paths.data_dir)},
        limit=ev.limit,
    )
    metrics: dict = {"lm_eval/version": lm_eval.__version__, "lm_eval/limit": ev.limit}
    lengths = results.pop(REQUEST_TOKENS, {})
    samples = results.get("samples") or {}  # lm-eval's logged examples (vLLM: trimmed)
    protected = prepared.policy.sink + prepared.policy.recent
    for t in tasks:
        key = t.result_key(data)
        row = results["results"][key]
        metric_name, _, filt = t.metric.partition(",")
        value = _number(row.get(t.metric))
        if value is None:
            raise KeyError(f"lm-eval reported no {t.metric} for {key}: {sorted(row)}")
        scale = 100 if t.percent else 1
        metrics[f"acc/{t.name}"] = scale * value
        stderr = _number(row.get(f"{metric_name}_stderr,{filt}"))
        if stderr is not None:
            metrics[f"acc_stderr/{t.name}"] = scale * stderr
        names = _members(key, results.get("group_subtasks", {}))
        n_samples = results.get("n-samples", {})  # a group (MMLU): its members' documents
        metrics[f"n/{t.name}"] = sum(n_samples.get(name, {}).get("effective", 0) for name in names)
        scores = document_scores(samples, names, t.metric)
        if scores is not None:  # in the metric's units (acc: 0 / 1), documents in doc_id order
            metrics[f"docs/{t.name}"] = scores
        for name, value in prompt_metrics(names, lengths, protected).items():
            metrics[f"{name}/{t.name}"] = value
    rates = [metrics[f"acc/{t.name}"] for t in tasks if t.percent]
    if rates:
        metrics["acc/avg"] = sum(rates) / len(rates)
    return attach_results(cfg, metrics, results)


def format_table(record: dict) -> str:
    """The record's tasks: rates in %, other metrics (bits per byte) in their own unit."""
    m = record["metrics"]
    lines = [f"{'task':<22}{'metric':>10}{'± stderr':>10}{'docs':>8}"]
    for name in record["config"]["eval"]["tasks"]:
        fmt = ".2f" if TASKS[name].percent else ".4f"
        stderr = m.get(f"acc_stderr/{name}")
        lines.append(
            f"{TASKS[name].label:<22}{m[f'acc/{name}']:>10{fmt}}"
            f"{'' if stderr is None else f'{stderr:{fmt}}':>10}{m.get(f'n/{name}', 0):>8}"
        )
    if "acc/avg" in m:
        lines.append(f"{'average (rates)':<22}{m['acc/avg']:>10.2f}")
    return "\n".join(lines)
