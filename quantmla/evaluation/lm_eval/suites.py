"""The lm-eval tasks of Tables 1 and 2 and of Fig. 4 (light: no lm-eval import).

Each column names the upstream lm-eval task it runs and the paper's metric; tasks whose documents
are in the local data folder also name the project task (quantmla/evaluation/lm_eval/tasks/) that runs
the same upstream task on them. `eval.data=local` (default) uses those, `eval.data=hub` the
upstream documents."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from quantmla.errors import ConfigError, DataNotFoundError
from quantmla.paths import hub_offline

TASKS_DIR = Path(__file__).parent / "tasks"
CODE_EVAL_ENV = "HF_ALLOW_CODE_EVAL"  # lm-eval's own opt-in for executing model-written code


@dataclass(frozen=True)
class SuiteTask:
    name: str  # column: metric keys acc/<name>, acc_stderr/<name> (the metric, in % if `percent`)
    label: str  # paper's column header
    upstream: str  # lm-eval task or group
    metric: str  # lm-eval "<metric>,<filter>"
    hub: str  # the dataset upstream reads
    local: str | None = None  # project group reading <data_dir>; None: hub only
    code: bool = False  # executes model-written code
    num_fewshot: int | None = None  # set where upstream's YAML leaves it to the command line
    percent: bool = True  # a rate, recorded in %; else recorded in the metric's own unit
    higher_is_better: bool = True

    def spec(self, data: str) -> str | dict:
        """What lm-eval loads: the local group (which states its own shots), the upstream task,
        or the upstream task/group wrapped with `num_fewshot`."""
        if data == "local" and self.local:
            return self.local
        if self.num_fewshot is None:
            return self.upstream
        kind = "group" if self.upstream in UPSTREAM_GROUPS else "task"
        return {
            "group": f"quantmla_hub_{self.name}",
            "task": [{kind: self.upstream, "num_fewshot": self.num_fewshot}],
        }

    def result_key(self, data: str) -> str:
        """Where lm-eval's results hold the metric: MMLU's group, else the (upstream) task."""
        if self.name != "mmlu":
            return self.upstream
        return self.local if data == "local" and self.local else self.upstream


UPSTREAM_GROUPS = {"mmlu"}  # upstream names that are lm-eval groups (of subject tasks), not tasks


def _t(name, label, upstream, metric, hub, local=None, code=False, shots=None, **kw) -> SuiteTask:
    return SuiteTask(name, label, upstream, metric, hub, local, code, shots, **kw)


TASKS: dict[str, SuiteTask] = {
    t.name: t
    for t in (
        _t(
            "hellaswag",
            "HellaSwag",
            "hellaswag",
            "acc_norm,none",
            "Rowan/hellaswag",
            "quantmla_hellaswag",
        ),
        _t("piqa", "PIQA", "piqa", "acc_norm,none", "baber/piqa", "quantmla_piqa"),
        _t(
            "arc_easy", "ARC-E", "arc_easy", "acc_norm,none", "allenai/ai2_arc", "quantmla_arc_easy"
        ),
        _t(
            "arc_challenge",
            "ARC-C",
            "arc_challenge",
            "acc_norm,none",
            "allenai/ai2_arc",
            "quantmla_arc_challenge",
        ),
        _t(
            "winogrande",
            "WinoGrande",
            "winogrande",
            "acc,none",
            "allenai/winogrande",
            "quantmla_winogrande",
        ),
        _t("mmlu", "MMLU", "mmlu", "acc,none", "cais/mmlu", "quantmla_mmlu", shots=5),
        *(  # few-shot commonsense: prompts longer than the 132 protected tokens read the cache
            _t(
                f"{name}_{n}shot",
                f"{label} {n}-shot",
                name,
                metric,
                hub,
                f"quantmla_{name}_{n}shot",
                shots=n,
            )  # fmt: skip
            for name, label, metric, hub, n in (
                ("hellaswag", "HellaSwag", "acc_norm,none", "Rowan/hellaswag", 10),
                ("piqa", "PIQA", "acc_norm,none", "baber/piqa", 5),
                ("arc_easy", "ARC-E", "acc_norm,none", "allenai/ai2_arc", 25),
                ("arc_challenge", "ARC-C", "acc_norm,none", "allenai/ai2_arc", 25),
                ("winogrande", "WinoGrande", "acc,none", "allenai/winogrande", 5),
            )
        ),
        _t("gsm8k", "GSM8K", "gsm8k", "exact_match,strict-match", "openai/gsm8k", "quantmla_gsm8k"),
        _t(  # ours: GSM8K's reference solutions teacher-forced, in bits per byte (tasks/ YAML)
            "gsm8k_reference",
            "GSM8K ref. bits/byte",
            "quantmla_gsm8k_reference",
            "bpb,none",
            "openai/gsm8k",
            "quantmla_gsm8k_reference_local",
            percent=False,
            higher_is_better=False,
        ),
        _t(  # ... each document with its own 5 examples, as upstream gsm8k draws them
            "gsm8k_reference_drawn",
            "GSM8K ref. bits/byte (drawn shots)",
            "quantmla_gsm8k_reference_drawn",
            "bpb,none",
            "openai/gsm8k",
            "quantmla_gsm8k_reference_drawn_local",
            percent=False,
            higher_is_better=False,
        ),
        _t("fda", "FDA", "fda", "contains,none", "hazyresearch/based-fda"),
        _t("swde", "SWDE", "swde", "contains,none", "hazyresearch/based-swde-v2"),
        _t(
            "squad_completion",
            "SQuAD",
            "squad_completion",
            "contains,none",
            "hazyresearch/based-squad",
        ),
        _t("gpqa_diamond", "GPQA-D", "gpqa_diamond_zeroshot", "acc,none", "Idavidrein/gpqa"),
        _t("math500", "MATH500", "minerva_math500", "math_verify,none", "HuggingFaceH4/MATH-500"),
        _t("aime25", "AIME25", "aime25", "exact_match,none", "math-ai/aime25"),
        _t(
            "humaneval",
            "HumanEval",
            "humaneval",
            "pass@1,create_test",
            "openai/openai_humaneval",
            code=True,
        ),
        _t(
            "livecodebench",
            "LCB",
            "quantmla_livecodebench",
            "pass@1,none",
            "livecodebench/code_generation_lite",
            code=True,
        ),
    )
}

RULER_TASKS = {
    "s_niah_1": "niah_single_1",
    "s_niah_2": "niah_single_2",
    "s_niah_3": "niah_single_3",
}
RULER_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)  # the YAMLs' metrics
DATA_MODES = ("local", "hub")


def _in_hub_cache(repo: str) -> bool:
    """Whether the datasets hub cache already holds `repo` (so it loads offline)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return (Path(HF_HUB_CACHE) / f"datasets--{repo.replace('/', '--')}").is_dir()


def data_mode(ev, data_dir) -> str:
    """eval.data, except that without a local data folder every task reads the hub."""
    return ev.data if data_dir is not None else "hub"


def check_ruler_samples(ev, max_positions: int | None) -> None:
    """eval.tasks and eval.context_lengths of a job that builds RULER's S-NIAH samples."""
    if not ev.tasks:
        raise ConfigError("eval.tasks", [], tuple(RULER_TASKS))
    for task in ev.tasks:
        if task not in RULER_TASKS:
            raise ConfigError("eval.tasks", task, tuple(RULER_TASKS))
    if not ev.context_lengths:
        raise ConfigError("eval.context_lengths", [], RULER_LENGTHS)
    for length in ev.context_lengths:
        if length not in RULER_LENGTHS:
            raise ConfigError("eval.context_lengths", length, RULER_LENGTHS)
        if max_positions is not None and length > max_positions:
            raise ConfigError(
                "eval.context_lengths",
                length,
                f"lengths <= the model's max_position_embeddings ({max_positions})",
            )


def check_lm_eval(ev, max_positions: int | None, data_dir) -> None:
    """eval.* of an lm_eval or ruler job, before anything loads: one line per fault."""
    if ev.data not in DATA_MODES:
        raise ConfigError("eval.data", ev.data, DATA_MODES)
    if ev.limit is not None and ev.limit <= 0:
        raise ConfigError("eval.limit", ev.limit, "null (every document) or >= 1")
    if not ev.tasks:
        raise ConfigError("eval.tasks", [], "at least one task")
    if ev.kind == "ruler":
        check_ruler_samples(ev, max_positions)
        return
    for name in ev.tasks:
        if name not in TASKS:
            raise ConfigError("eval.tasks", name, tuple(TASKS))
    upstream = [TASKS[n].upstream for n in ev.tasks]
    clash = sorted({n for n in ev.tasks if upstream.count(TASKS[n].upstream) > 1})
    if clash:  # lm-eval would report both under one task name
        raise ConfigError(
            "eval.tasks",
            clash,
            "at most one shot count per upstream task in a job (run the others in another job)",
        )
    code = [n for n in ev.tasks if TASKS[n].code]
    if code and os.environ.get(CODE_EVAL_ENV) != "1":
        raise ConfigError(
            "eval.tasks",
            code,
            f"tasks that do not execute model-written code, or opt in with {CODE_EVAL_ENV}=1 "
            "(runs it in a subprocess with time/memory limits and no network)",
        )
    if hub_offline():
        for name in ev.tasks:
            task = TASKS[name]
            if task.spec(data_mode(ev, data_dir)) == task.upstream and not _in_hub_cache(task.hub):
                raise DataNotFoundError(
                    f"eval.tasks: {name!r} reads {task.hub} from the hub, which is offline and "
                    "not cached; run once online (the datasets cache keeps it)"
                    + (", or use eval.data=local" if task.local else "")
                )


def check(cfg, job) -> None:
    """eval.kind=lm_eval / ruler: the suite's fields, the data it reads, the packed cache's limit."""
    from quantmla.data.sources import resolve_data_dir

    data_dir = resolve_data_dir(job.paths.data_dir)
    check_lm_eval(cfg.eval, getattr(job.model_config, "max_position_embeddings", None), data_dir)
    if cfg.eval.engine not in ("hf", "vllm"):
        raise ConfigError("eval.engine", cfg.eval.engine, ("hf", "vllm"))
    if cfg.eval.engine == "vllm":
        from quantmla.serving.settings import check_servable

        check_servable(job.paths.serve_python, job.model_config, job.policy, "eval.engine=vllm")
    if job.policy.backend == "packed" and cfg.eval.batch_size > 1:
        raise ConfigError(
            "eval.batch_size",
            cfg.eval.batch_size,
            "1 with cache.backend=packed (lm-eval left-pads batched prompts; the packed cache "
            "has no per-request start offset yet)",
        )
    if cfg.eval.kind == "ruler" and data_mode(cfg.eval, data_dir) == "local":
        check_essays(job.paths.data_dir)


def check_essays(data_dir) -> None:
    from quantmla.evaluation.lm_eval.niah import essays_folder

    folder = essays_folder(data_dir)
    if not any(folder.glob("*.txt")):
        raise DataNotFoundError(
            f"RULER's haystack: no essays (*.txt) in {folder}; put the Paul Graham essays there "
            "(see shared/data/niah-paul-graham-essays) or set paths.data_dir"
        )
