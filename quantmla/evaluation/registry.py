"""The evaluators by `eval.kind` (light: imports nothing heavy).

Each implemented kind names a module with `evaluate(cfg, prepared) -> metrics` and
`format_table(record) -> str`, the `eval.*` fields it reads (`fields`: the only ones its record
hash covers, and the only ones it can see at run time) and, optionally, its own checks
(`check`: "module:function" taking `(cfg, job)`, run before anything loads). A kind whose module is
None has its configs (so sweeps compose and validate) and stops with "not implemented yet"."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

PERPLEXITY_FIELDS = (
    "datasets",
    "splits",
    "max_windows",
    "batch_size",
    "compare_bf16",
    "nmse_windows",
)
LM_EVAL_FIELDS = (
    "tasks",
    "limit",
    "data",
    "max_gen_toks",
    "apply_chat_template",
    "batch_size",
    "engine",
    "prefix_cache",
)
STUDY_FIELDS = (
    "datasets",
    "splits",
    "n_sequences",
    "seqlen",
    "layers",
    "paths",
    "target_nmse",
    "batch_size",
)


# Fields added after records existed, left out of a record's config at these values so that the
# records written before them keep their keys.
HASH_NEUTRAL = {"trial": 0}


@dataclass(frozen=True)
class Evaluator:
    kind: str
    module: str | None  # None: not implemented yet
    description: str
    fields: tuple[str, ...] = ()  # the eval.* fields this kind reads (besides `kind`)
    check: str | None = None  # "module:function(cfg, job)": this kind's own checks
    needs_model: bool = True  # False: analytic, the model's config is enough
    needs_data: bool = True
    mixed: bool = False  # runs a mixed allocation (reads only each layer's own patch)
    # one capture of `eval.n_sequences` × `eval.seqlen`, studied layer by layer
    layer_study: bool = False

    @property
    def implemented(self) -> bool:
        return self.module is not None

    def _load(self):
        return importlib.import_module(self.module)

    def evaluate(self, cfg, prepared) -> dict:
        return self._load().evaluate(cfg, prepared)

    def format_table(self, record: dict) -> str:
        return self._load().format_table(record)

    def run_checks(self, cfg, job) -> None:
        if self.check:
            module, function = self.check.split(":")
            getattr(importlib.import_module(module), function)(cfg, job)


EVALUATORS: dict[str, Evaluator] = {
    e.kind: e
    for e in (
        Evaluator(
            "perplexity",
            "quantmla.evaluation.perplexity",
            "WikiText-2/C4 perplexity and per-layer attention-output NMSE",
            PERPLEXITY_FIELDS,
            "quantmla.evaluation.perplexity:check",
            mixed=True,
        ),
        Evaluator(
            "memory",
            "quantmla.evaluation.memory",
            "persistent cache bytes of the packed layout (Fig. 5a)",
            ("context_lengths",),
            needs_model=False,
            needs_data=False,
        ),
        Evaluator(
            "lm_eval",
            "quantmla.evaluation.lm_eval.runner",
            "lm-eval suites of Tables 1 and 2",
            LM_EVAL_FIELDS,
            "quantmla.evaluation.lm_eval.suites:check",
            mixed=True,
        ),
        Evaluator(
            "ruler",
            "quantmla.evaluation.lm_eval.ruler",
            "RULER S-NIAH (Fig. 4)",
            (*LM_EVAL_FIELDS, "context_lengths"),
            "quantmla.evaluation.lm_eval.suites:check",
            mixed=True,
        ),
        Evaluator(
            "ruler_answer",
            "quantmla.evaluation.ruler_answer",
            "RULER S-NIAH answers teacher-forced: log-likelihood and whole-answer argmax per sample",
            ("tasks", "context_lengths", "limit"),
            "quantmla.evaluation.ruler_answer:check",
            mixed=True,
        ),
        Evaluator(
            "retrieval",
            "quantmla.evaluation.retrieval",
            "needle retrieval on held-out phrasings (the second testbed)",
            ("haystacks", "context_lengths", "limit", "max_gen_toks", "compare_bf16"),
            "quantmla.evaluation.retrieval:check",
            mixed=True,
        ),
        Evaluator(
            "sensitivity",
            "quantmla.evaluation.studies.sensitivity",
            "per-layer path sensitivity (Fig. 2/6, Table 4)",
            STUDY_FIELDS,
            "quantmla.evaluation.studies.layer_study:check",
            layer_study=True,
        ),
        Evaluator(
            "probes",
            "quantmla.evaluation.studies.probes",
            "Rademacher-probe operator analysis (Tables 5/6, Fig. 7)",
            (*STUDY_FIELDS, "probes", "probe_chunk", "interventions"),
            "quantmla.evaluation.studies.layer_study:check",
            layer_study=True,
        ),
        Evaluator(
            "rope_positions",
            "quantmla.evaluation.studies.rope_positions",
            "the RoPE key's positional QK error by key position (calibrated angles past their range)",
            STUDY_FIELDS,
            "quantmla.evaluation.studies.layer_study:check",
            layer_study=True,
        ),
        Evaluator(
            "latency",
            "quantmla.evaluation.latency",
            "decode latency of the packed-cache kernels (Fig. 5b; CUDA only)",
            ("context_lengths",),
            needs_model=False,
            needs_data=False,
        ),
        Evaluator(
            "throughput",
            "quantmla.evaluation.throughput",
            "cache-pressure throughput through vLLM with the QuantMLA backend (Fig. 5c)",
            (
                "requests",
                "input_tokens",
                "output_tokens",
                "kv_cache_memory_bytes",
                "max_num_seqs",
                "max_num_batched_tokens",
                "first_chunk_admission",
                "tensor_parallel",
                "trial",
            ),
            "quantmla.evaluation.throughput:check",
        ),
    )
}
