"""The evaluators by `eval.kind` (light: imports nothing heavy).

Each implemented kind names a module with `evaluate(cfg, prepared) -> metrics` and
`format_table(record) -> str`. A kind whose module is None has its configs (so sweeps compose and
validate) and stops with "not implemented yet" before anything loads."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Evaluator:
    kind: str
    module: str | None  # None: not implemented yet
    description: str
    needs_model: bool = True  # False: analytic, the model's config is enough
    needs_data: bool = True

    @property
    def implemented(self) -> bool:
        return self.module is not None

    def _load(self):
        return importlib.import_module(self.module)

    def evaluate(self, cfg, prepared) -> dict:
        return self._load().evaluate(cfg, prepared)

    def format_table(self, record: dict) -> str:
        return self._load().format_table(record)


EVALUATORS: dict[str, Evaluator] = {
    e.kind: e
    for e in (
        Evaluator(
            "perplexity",
            "quantmla.evaluation.perplexity",
            "WikiText-2/C4 perplexity and per-layer attention-output NMSE",
        ),
        Evaluator(
            "memory",
            "quantmla.evaluation.memory",
            "persistent cache bytes of the packed layout (Fig. 5a)",
            needs_model=False,
            needs_data=False,
        ),
        Evaluator(
            "lm_eval", "quantmla.evaluation.lm_eval_suite", "lm-eval suites of Tables 1 and 2"
        ),
        Evaluator("ruler", "quantmla.evaluation.ruler", "RULER S-NIAH (Fig. 4)"),
        Evaluator(
            "retrieval",
            "quantmla.evaluation.retrieval",
            "needle retrieval on held-out phrasings (the second testbed)",
        ),
        Evaluator(
            "sensitivity",
            "quantmla.evaluation.sensitivity",
            "per-layer path sensitivity (Fig. 2/6, Table 4)",
        ),
        Evaluator(
            "probes",
            "quantmla.evaluation.probes",
            "Rademacher-probe operator analysis (Tables 5/6, Fig. 7)",
        ),
        Evaluator(
            "latency",
            "quantmla.evaluation.latency",
            "decode latency of the packed-cache kernels (Fig. 5b; CUDA only)",
            needs_model=False,
            needs_data=False,
        ),
        Evaluator("throughput", None, "cache-pressure throughput (Fig. 5c)"),
    )
}
