"""lm-eval's own `vllm` model type over an export with the QuantMLA backend, in the serving venv:
the worker behind `eval.engine=vllm` (`runner.run_on_vllm` writes the request and reads the
results back).

    python -m quantmla.evaluation.lm_eval.vllm_worker REQUEST.json RESULTS.json

REQUEST holds the export, the cache (`precision`: bf16 for the BF16 mode, null for the export's
format), the engine sizes, and `simple_evaluate`'s arguments (task specs, the task folder, the
tasks' metadata, limit, generation, seeds and the job's request cache, `use_cache`). RESULTS keeps
the parts of lm-eval's results the runner reads: `results`, `n-samples`, `group_subtasks`, and
`samples` trimmed to per-document scores.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from quantmla.evaluation.lm_eval.samples import trim
from quantmla.serving.engine import alias_vllm_distribution, engine_args

# requests per vLLM call, each call's answers saved (RULER on 2 CPU cores: 23 s at 1K, ~10 min at 8K)
RESUME_CHUNK = 16


def resumable_vllm():
    """lm-eval's `vllm` model whose generations are saved, a chunk at a time, under the key its
    request cache reads them back by (the request's own arguments). lm-eval 0.4.13's saves them
    under the normalised generation arguments (stop strings with EOS, max_gen_toks), which no
    lookup asks for: a stopped RULER job resumed from nothing."""
    alias_vllm_distribution()
    from lm_eval.api.model import CacheHook
    from lm_eval.models.vllm_causallms import VLLM
    from tqdm.auto import tqdm

    class ResumableVLLM(VLLM):
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            saves, self.cache_hook = self.cache_hook, CacheHook(None)  # its own saves: unread
            answers: list[str] = []
            bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
            try:
                for start in range(0, len(requests), RESUME_CHUNK):
                    chunk = requests[start : start + RESUME_CHUNK]
                    texts = super().generate_until(chunk, disable_tqdm=True)
                    for req, text in zip(chunk, texts, strict=True):
                        saves.add_partial("generate_until", req.args, text)
                    answers += texts
                    bar.update(len(chunk))
            finally:
                bar.close()
                self.cache_hook = saves
            return answers

    return ResumableVLLM


def run(request: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    alias_vllm_distribution()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if any("niah" in spec for spec in request["tasks"]):
        from quantmla.evaluation.lm_eval.ruler import import_upstream_ruler_quietly

        import_upstream_ruler_quietly()
    engine = request["engine"]
    args = engine_args(request["model"], **engine)
    # answers saved a chunk at a time (`use_cache`): a stopped job resumes
    model = resumable_vllm()(pretrained=args.pop("model"), batch_size=RESUME_CHUNK, **args)
    results = simple_evaluate(
        model=model,
        tasks=request["tasks"],
        limit=request.get("limit"),
        task_manager=TaskManager(
            include_path=request["include_path"], metadata=request["metadata"]
        ),
        gen_kwargs=request.get("gen_kwargs"),
        apply_chat_template=request.get("apply_chat_template", False),
        log_samples=True,
        bootstrap_iters=1000,
        confirm_run_unsafe_code=request.get("confirm_run_unsafe_code", False),
        random_seed=request["seed"],
        numpy_random_seed=request["seed"],
        torch_random_seed=request["seed"],
        fewshot_random_seed=1234,
        use_cache=request.get("use_cache"),
    )
    kept = {k: results.get(k, {}) for k in ("results", "n-samples", "group_subtasks")}
    return kept | {"samples": trim(results.get("samples") or {})}


def main() -> None:
    request_file, out_file = sys.argv[1:3]
    out = run(json.loads(Path(request_file).read_text()))
    Path(out_file).write_text(json.dumps(out, default=str) + "\n")


if __name__ == "__main__":
    main()
