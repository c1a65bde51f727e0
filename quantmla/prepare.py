"""The one prepare step every evaluator starts from, in three named steps: `load` (checkpoint,
simulator patch at BF16) → `allocate` (precision=mixed only: each layer's format) → `finish`
(method: load its artifact or calibrate; fuse + equivalence check; the run's cache policy)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from torch import nn

from quantmla.paths import Paths
from quantmla.policy import CachePolicy


@dataclass
class Prepared:
    """What an evaluator gets. `model` is None for analytic evaluators (the config is enough)."""

    model_config: object  # transformers config
    policy: CachePolicy
    paths: Paths
    model: nn.Module | None = None
    tokenizer: object = None
    adapter: object = None
    modules: list[nn.Module] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # method/*, equivalence/*, resumed/* for the record
    method_result: object = None  # the fused MethodResult (None for RTN)
    weights: str | None = None  # fingerprint of the local checkpoint's weights (None: a hub id)
    record_path: Path | None = None  # the job's record: its progress is kept beside it

    @contextmanager
    def unquantized(self):
        """Quantization off (the BF16 reference); fused transforms stay, they are exact."""
        from quantmla.simulator import set_policy

        set_policy(self.model, precision="bf16")
        try:
            yield self
        finally:
            set_policy(self.model, precision=self.policy.precisions(len(self.modules)))


def equivalence_sequences(cfg, paths, tokenizer, n: int = 2):
    """The first `n` WikiText-2 valid windows: the fusion-equivalence probe's inputs."""
    from quantmla.data import load_text, perplexity_windows, tokenize

    ids = tokenize(load_text("wikitext2", "valid", paths.data_dir), tokenizer)
    return perplexity_windows(ids, cfg.model.eval_seqlen, n)


def prepare(job) -> Prepared:
    """The model of a resolved job (`quantmla.job.Job`), ready for its evaluator; only the published
    config for analytic evaluators."""
    if not job.evaluator.needs_model:
        return Prepared(job.model_config, job.policy, job.paths, record_path=job.record_path)
    prepared = load(job)
    prepared.record_path = job.record_path
    if prepared.policy.mixed:  # one format per layer, chosen before any method calibrates at it
        allocate(job, prepared)
    return finish(job, prepared)


def load(job) -> Prepared:
    """The checkpoint, its MLA modules patched with the simulator at BF16."""
    from quantmla.models.adapters import get_adapter
    from quantmla.models.loading import load_pretrained
    from quantmla.simulator import patch_model

    cfg, policy = job.cfg, job.policy
    model, tokenizer = load_pretrained(
        job.paths.checkpoint(cfg.model.path),
        cfg.model.dtype,
        cfg.model.trust_remote_code,
        cfg.model.device,
        cfg.model.fp8,
    )
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    patch_model(model, "bf16", sink=policy.sink, recent=policy.recent, group_size=policy.group_size)
    prepared = Prepared(model.config, policy, job.paths, model, tokenizer, adapter, modules)
    prepared.weights = job.weights
    return prepared


def allocate(job, prepared: Prepared) -> None:
    """`precision=mixed`: each layer's format (`quantmla.mixed`), into the policy and the metrics."""
    from quantmla.mixed import allocate_for_job

    allocation, report = allocate_for_job(
        job, prepared.model, prepared.adapter, prepared.modules, prepared.tokenizer
    )
    prepared.policy = replace(prepared.policy, layer_precisions=allocation.precisions)
    prepared.metrics.update(
        {f"allocation/{k}": v for k, v in {**allocation.to_dict(), **report}.items()}
    )


def finish(job, prepared: Prepared) -> Prepared:
    """The method at the policy's formats (loaded or calibrated), fused and checked for
    equivalence, then the cache policy switched on."""
    from quantmla.methods.base import apply_method
    from quantmla.methods.equivalence import EquivalenceProbe
    from quantmla.methods.prepare import prepare_method
    from quantmla.simulator import set_policy

    cfg, paths, policy = job.cfg, job.paths, prepared.policy
    model, adapter, modules, tokenizer = (
        prepared.model, prepared.adapter, prepared.modules, prepared.tokenizer
    )  # fmt: skip
    prepared.metrics.update(cache_bytes(policy, adapter, modules, cfg.model.eval_seqlen))
    started = time.time()
    specs = policy.specs(len(modules))
    result = prepare_method(cfg, paths, model, adapter, tokenizer, specs, job.weights)
    prepared.metrics["method/seconds"] = time.time() - started
    prepared.method_result = result
    if result is not None:
        probe = EquivalenceProbe(equivalence_sequences(cfg, paths, tokenizer))
        probe.capture(model, modules)
        apply_method(model, adapter, result)
        prepared.metrics.update(
            {f"equivalence/{k}": v for k, v in probe.check(model, modules).items()}
        )
        if result.report:
            prepared.metrics["method/report"] = result.report
    set_policy(
        model,
        precision=policy.precisions(len(modules)),
        backend=policy.backend,
        kernel=policy.kernel,
    )
    return prepared


def cache_bytes(policy: CachePolicy, adapter, modules, length: int) -> dict[str, float]:
    """Bytes per token and layer of the run's cache in the memory model (mean over layers): the
    packed codes alone, and with the BF16 protection of one `length`-token request amortised."""
    from quantmla.memory import CacheLayout

    layouts = [
        CacheLayout(spec, g.d_c, g.d_r, policy.sink, policy.recent)
        for spec, g in zip(policy.specs(len(modules)), map(adapter.geometry, modules))
    ]
    return {
        "cache/bytes_per_token": sum(x.token_bytes() for x in layouts) / len(layouts),
        "cache/bytes_per_token_protected": sum(
            x.token_bytes() + x.protection_bytes() / length for x in layouts
        )
        / len(layouts),
        "cache/protected_at": length,
    }
