"""A job's mixed allocation (`precision=mixed`, issue #23): each MLA layer's cache format, chosen
by the exact allocator (`quantmla.allocation`) from what every candidate format costs each layer
*after the job's method*: its transforms at that format (calibrated once per candidate, artifacts
kept) applied to the layer's own latents (WikiText-2 valid windows through the BF16 model). The
cost is the sensitivity records' R_C, R_P times each path's cache NMSE (`allocation_error=response`),
the layer's measured output NMSE (`output`), or that weighted by its measured KL per unit (`loss`).
With `joint_top` k > 1 the error model's k best allocations run whole and the lowest next-token
KL to BF16 wins (the models add layers up; the joint run does not). Methods then calibrate each
layer at its chosen format; the record carries the choice, its prediction and every input."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from quantmla.allocation import Allocation, best_allocations, format_bytes, predicted_errors
from quantmla.attention import attention_output, protected_mask
from quantmla.calibration.context import CalibrationContext
from quantmla.calibration.objectives import content_qdq, rope_qdq
from quantmla.config import ALLOCATION_ERRORS, ALLOCATION_METHODS
from quantmla.errors import ConfigError, DataNotFoundError
from quantmla.metrics import nmse
from quantmla.models.capture import capture_inputs
from quantmla.quant import qdq_content
from quantmla.spec import UNQUANTIZED_BITS
from quantmla.tracking.store import load_records
from quantmla.transforms import RopeTransform, cached_rope_matrices, online_rope_matrix


def sensitivity_responses(job) -> tuple[np.ndarray, np.ndarray, int]:
    """(R̄_C, R̄_P) per layer, means over the cells of the job's sensitivity records (same model
    path and weights, every layer), and the number of cells; one line if there are none."""
    p, model = job.cfg.precision, job.cfg.model
    found = [
        r
        for r in load_records(job.paths.results_dir, p.sensitivity_experiment)
        if r["config"]["eval"]["kind"] == "sensitivity"
        and r["config"]["model"]["path"] == model.path
        and r["config"]["model"].get("weights") == job.weights
        and not r["config"]["eval"].get("layers")  # every layer
    ]
    if not found:
        raise DataNotFoundError(
            f"precision=mixed reads R_C, R_P from sensitivity records: none for model.path={model.path!r} "
            f"(these weights, every layer) in {job.paths.results_dir / p.sensitivity_experiment}; run "
            f"`python -m quantmla.run eval=sensitivity model={model.name} experiment_name={p.sensitivity_experiment}` "
            "or set precision.sensitivity_experiment"
        )
    rc = np.mean([r["metrics"]["sensitivity/R_content"] for r in found], axis=0)
    rp = np.mean([r["metrics"]["sensitivity/R_rope"] for r in found], axis=0)
    return rc, rp, len(found)


def check(job) -> None:
    """Before anything loads: the candidates, the budget against them, the sensitivity records."""
    p, policy = job.cfg.precision, job.policy
    if p.budget_bytes is None:
        raise ConfigError(
            "precision.budget_bytes", None, "mean bytes per token and layer, e.g. 192"
        )
    if not p.candidates:
        raise ConfigError(
            "precision.candidates", p.candidates, "one or more formats, e.g. [c2r4, c4r4, bf16]"
        )
    if "mixed" in p.candidates:
        raise ConfigError("precision.candidates", "mixed", "single formats")
    config = job.model_config
    for name in p.candidates:
        layer = policy.layer(name)  # validates the format
        if config is not None:
            layer.check_dims(config.kv_lora_rank, config.qk_rope_head_dim)
    if p.allocation_windows < 1:
        raise ConfigError("precision.allocation_windows", p.allocation_windows, ">= 1")
    if p.joint_top < 1:
        raise ConfigError("precision.joint_top", p.joint_top, ">= 1 (1: no joint check)")
    if p.allocation_error not in ALLOCATION_ERRORS:
        raise ConfigError("precision.allocation_error", p.allocation_error, ALLOCATION_ERRORS)
    if p.allocation_method not in ALLOCATION_METHODS:
        raise ConfigError("precision.allocation_method", p.allocation_method, ALLOCATION_METHODS)
    if job.cfg.method.artifact:
        raise ConfigError(
            "method.artifact", job.cfg.method.artifact,
            "unset with precision=mixed (it calibrates at every candidate; artifacts are found by metadata)",
        )  # fmt: skip
    if config is not None:
        sizes = format_bytes(
            p.candidates, config.kv_lora_rank, config.qk_rope_head_dim, p.group_size
        )
        if sizes.min() > p.budget_bytes:
            raise ConfigError(
                "precision.budget_bytes",
                p.budget_bytes,
                f">= {int(sizes.min())} (the smallest candidate, {p.candidates[int(sizes.argmin())]})",
            )
    if p.allocation_error == "response":
        sensitivity_responses(job)


ERROR_KEYS = ("cache_content", "cache_rope", "output_content", "output_rope")


def _digest(*tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().double().numpy().tobytes())
    return h.hexdigest()


def _layer_paths(ctx, layer: int, result, dtype: torch.dtype):
    """One layer's two path QDQs under a method's result (None: RTN): c ↦ ĉ in native coordinates;
    (q_R, k_R) ↦ (q̂_R, k̂_R) as scored; the key matrix M_K and its inverse (back to native); and
    each path's transform digest, so candidates sharing a path format and transform measure it once."""
    g = ctx.adapter.geometry(ctx.modules[layer])
    transforms = result.layers[layer] if result is not None else None
    fused = transforms.content if transforms is not None else None
    if fused is not None:
        gamma, rotation, scale = (
            t.to(ctx.device, dtype) for t in (ctx.gamma(layer), fused.rotation, fused.scale)
        )
        content = lambda c, spec: content_qdq(c, gamma, rotation, scale, spec)  # noqa: E731
    else:
        content = lambda c, spec: qdq_content(spec, c)  # noqa: E731
    rope = (transforms and transforms.rope) or RopeTransform.identity(g.d_r)
    online = online_rope_matrix(result.rope_online if result is not None else None, g.d_r)
    key, query = cached_rope_matrices(rope, g.cache_pairs, online)
    key, query = key.to(ctx.device, dtype), query.to(ctx.device, dtype)
    digests = (_digest(fused.rotation, fused.scale) if fused is not None else "", _digest(key))
    scored = lambda q, k, spec: rope_qdq(q, k, key, query, spec)  # noqa: E731
    return content, scored, key, torch.linalg.inv(key), digests


def _protection_masks(b: int, n: int, sink: int, recent: int, device):
    """(quantized, protected) (B, 1, n, n) causal masks: keys read from the cache vs in BF16."""
    allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    protected = protected_mask(torch.arange(n, device=device), n, sink, recent)
    return tuple(m.expand(b, 1, n, n) for m in (allowed & ~protected, allowed & protected))


def _output(module, adapter, proj, q_rot, cached, exact, masks):
    """Post-o_proj output reading the keys outside the protection from `cached` (c, k_R) and the
    protected ones from `exact`, all scored by `q_rot`."""
    regions = [(*cached, masks[0]), (*exact, masks[1])]
    return attention_output(module, adapter, proj.q_nope, q_rot, regions, form="expanded")


@torch.no_grad()
def format_errors(
    ctx, results: dict, specs: dict, sink: int, recent: int, batch_size: int = 2
) -> dict[str, np.ndarray]:
    """Every candidate format on every layer, after the job's method at that format (`results`:
    format → MethodResult or None), each layer fed the BF16 model's inputs: each path's cache NMSE
    in native coordinates (`cache_content`, `cache_rope`), and the post-o_proj output NMSE with that
    path alone quantized outside the BF16 protection (`output_content`, `output_rope`): (L, K)
    each, 0 for a BF16 path."""
    names, batches = list(specs), ctx.calibration.split(batch_size)
    out = {key: np.zeros((len(ctx.modules), len(names))) for key in ERROR_KEYS}
    for layer, module in enumerate(tqdm(ctx.modules, desc="format errors", leave=False)):
        dt = module.o_proj.weight.dtype
        work = torch.promote_types(dt, torch.float32)  # the QDQ in float32 at least
        paths = [_layer_paths(ctx, layer, results[name], work) for name in names]
        keys = [
            (
                (s.content_bits, s.content_format, s.group_size, s.content_meta_dtype, digests[0]),
                (s.rope_bits, s.rope_format, s.group_size, s.rope_meta_dtype, digests[1]),
            )
            for s, (*_, digests) in zip(specs.values(), paths)
        ]
        for index in batches:
            proj, y = ctx.project(layer, index)
            c, q, k = (t.to(work) for t in (proj.c, proj.q_rot, proj.k_rot))
            masks = _protection_masks(*proj.c.shape[:2], sink, recent, proj.c.device)

            measured = {}  # path key → (cache NMSE, output NMSE) on this batch
            for j, name in enumerate(names):
                spec, (content, scored, key, native, _) = specs[name], paths[j]
                if spec.content_bits < UNQUANTIZED_BITS and keys[j][0] not in measured:
                    c_hat = content(c, spec)
                    o = _output(
                        module, ctx.adapter, proj, proj.q_rot,
                        (c_hat.to(dt), proj.k_rot), (proj.c, proj.k_rot), masks,
                    )  # fmt: skip
                    measured[keys[j][0]] = float(nmse(c_hat, c)), float(nmse(o, y))
                if spec.rope_bits < UNQUANTIZED_BITS and keys[j][1] not in measured:
                    q_hat, k_hat = scored(q, k, spec)
                    o = _output(
                        module, ctx.adapter, proj, q_hat.to(dt),
                        (proj.c, k_hat.to(dt)), (proj.c, (k @ key).to(dt)), masks,
                    )  # fmt: skip
                    measured[keys[j][1]] = float(nmse(k_hat @ native, k)), float(nmse(o, y))
                for path, key_j in zip(("content", "rope"), keys[j]):
                    cache, out_nmse = measured.get(key_j, (0.0, 0.0))
                    out[f"cache_{path}"][layer, j] += cache
                    out[f"output_{path}"][layer, j] += out_nmse
    return {key: v / len(batches) for key, v in out.items()}


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean next-token KL(P ‖ Q) per token, P from the reference log-probabilities."""
    logq = torch.log_softmax(_wide(logits), dim=-1)
    return float((reference.exp() * (reference - logq)).sum(-1).mean())


# the format each layer is perturbed at to measure how its output error propagates
LOSS_PROBE = "c2r4"


@torch.no_grad()
def loss_weights(model, modules, windows, probe: str = LOSS_PROBE, batch_size: int = 2):
    """Per layer ℓ, with ℓ alone cached at `probe` (RTN, protection as patched) and every other
    layer BF16: the next-token KL(BF16 ‖ perturbed) per token, layer ℓ's own post-o_proj output
    NMSE in the same run, and their ratio w_ℓ (nats per unit output NMSE): (3, L)."""
    from quantmla.simulator import set_policy

    n, device = len(modules), next(model.parameters()).device
    kl, out_nmse, batches = np.zeros(n), np.zeros(n), windows.split(batch_size)
    captured = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, i=i: captured.__setitem__(i, _wide(out[0])))
        for i, m in enumerate(modules)
    ]
    try:
        for batch in batches:
            batch = batch.to(device)
            set_policy(model, precision="bf16")
            reference = torch.log_softmax(_wide(model(batch).logits), dim=-1)
            teacher = dict(captured)
            for layer in range(n):
                set_policy(model, precision=["bf16"] * layer + [probe] + ["bf16"] * (n - layer - 1))
                kl[layer] += _kl(reference, model(batch).logits)
                out_nmse[layer] += float(nmse(captured[layer], teacher[layer]))
    finally:
        for h in hooks:
            h.remove()
        set_policy(model, precision="bf16")
    kl, out_nmse = kl / len(batches), out_nmse / len(batches)
    return kl, out_nmse, kl / np.maximum(out_nmse, 1e-30)


@torch.no_grad()
def joint_kl(model, adapter, modules, results: dict, allocations, windows, batch_size: int = 2):
    """Per allocation (one format per layer), the next-token KL(BF16 ‖ quantized) per token on
    `windows` with every layer cached at its own format and the job's transforms at that format
    fused (`results`: format → method result or None): the allocation's joint error, which the
    per-layer error models only add up. The model is left as it came (unfused, BF16); a layer's
    unfused weights are copied once, the first time a transform is fused into it."""
    from quantmla.methods.base import fuse_layer
    from quantmla.simulator import layer_patch, set_policy

    device = next(model.parameters()).device
    originals = [None] * len(modules)  # each layer's unfused state, once it gets fused
    current = [None] * len(modules)  # the format whose transforms each layer holds now

    def hold(layer: int, name: str | None) -> None:
        result = results.get(name)
        key = None if result is None else name
        if current[layer] == key:
            return
        module = modules[layer]
        if originals[layer] is None:
            originals[layer] = {k: v.clone() for k, v in module.state_dict().items()}
        else:
            module.load_state_dict(originals[layer])
        layer_patch(module).rope_online = None
        if result is not None:
            fuse_layer(module, adapter, result.layers[layer], result.rope_online)
        current[layer] = key

    kl, batches = np.zeros(len(allocations)), windows.split(batch_size)
    bar = tqdm(total=len(batches) * len(allocations), desc="joint check", leave=False)
    try:
        for batch in batches:
            batch = batch.to(device)
            for layer in range(len(modules)):
                hold(layer, None)  # the reference: the unfused BF16 model
            set_policy(model, precision="bf16")
            reference = torch.log_softmax(_wide(model(batch).logits), dim=-1)
            for i, precisions in enumerate(allocations):
                for layer, name in enumerate(precisions):
                    hold(layer, name)
                set_policy(model, precision=list(precisions))
                kl[i] += _kl(reference, model(batch).logits)
                bar.update()
    finally:
        bar.close()
        for layer in range(len(modules)):
            hold(layer, None)
        set_policy(model, precision="bf16")
    return kl / len(batches)


def candidate_results(job, model, adapter, modules, tokenizer, specs: dict) -> dict:
    """The job's method at every candidate format, uniform over layers: None for RTN and BF16
    (and for every candidate with `allocation_method=rtn`),
    QuaRot†'s fixed rotation, or SmoothQuant†/QuantMLA artifacts (loaded, or calibrated once and
    kept: uniform jobs at that format share them). Layers calibrate independently, so layer ℓ's
    transforms at format f are the ones a mixed calibration gives it at f."""
    from quantmla.methods.prepare import prepare_method

    results = {}
    for i, (name, spec) in enumerate(specs.items()):
        if (
            "rtn" in (job.cfg.method.name, job.cfg.precision.allocation_method)
            or not spec.quantized
        ):
            results[name] = None
            continue
        print(f"[quantmla] mixed: {job.cfg.method.name} at candidate {name} ({i + 1}/{len(specs)})")
        results[name] = prepare_method(
            job.cfg, job.paths, model, adapter, tokenizer, [spec] * len(modules), job.weights
        )
    return results


@dataclass
class Measured:
    """What every candidate format costs each layer after the job's method, on the allocation
    windows: the method's result per candidate and each layer's per-path errors."""

    candidates: list[str]
    results: dict  # candidate -> the method's result at it (None: nothing applied)
    windows: torch.Tensor
    errors: dict[str, np.ndarray]  # ERROR_KEYS -> (layers, candidates)
    d_c: int
    d_r: int
    loaded_from: str | None = None  # the saved errors' file, when measured by an earlier job


def measure_candidates(job, model, adapter, modules, tokenizer) -> Measured:
    """The method at every candidate, then each layer's cache and output errors at each."""
    from quantmla.data import load_text, perplexity_windows, tokenize

    cfg, p = job.cfg, job.cfg.precision
    geometries = {(g.d_c, g.d_r) for g in map(adapter.geometry, modules)}
    if len(geometries) != 1:
        raise ConfigError("precision", "mixed", "a model whose MLA layers share d_c and d_r")
    (d_c, d_r), candidates = geometries.pop(), list(p.candidates)
    specs = {name: job.policy.layer(name).spec for name in candidates}
    results = candidate_results(job, model, adapter, modules, tokenizer, specs)
    ids = tokenize(load_text("wikitext2", "valid", job.paths.data_dir), tokenizer)
    windows = perplexity_windows(ids, cfg.model.eval_seqlen, p.allocation_windows)
    saved = None
    if all(r is None for r in results.values()):  # no transforms: the same for every such job
        saved = SavedErrors(job, model, specs, windows)
        errors = saved.load()
        if errors is not None:
            return Measured(candidates, results, windows, errors, d_c, d_r, saved.path.name)
    store = capture_inputs(model, modules, windows)
    ctx = CalibrationContext(
        model, adapter, modules, store, torch.arange(windows.shape[0]), torch.arange(0)
    )
    errors = format_errors(ctx, results, specs, job.policy.sink, job.policy.recent)
    if saved is not None:
        saved.save(errors)
    return Measured(candidates, results, windows, errors, d_c, d_r)


class SavedErrors:
    """The candidates' measured errors without transforms (RTN, or `allocation_method=rtn`: ~45
    min on SmolLM2-MLA) kept as `<artifacts>/allocation/<metadata hash>.json`, so the jobs
    that differ only in budget, joint check, the method fitted afterwards or a subset of the
    candidates (each candidate's errors are measured on their own) measure them once. The
    metadata pins what they depend on: weights, model, candidate quantizers, protection, the
    windows' token ids and the measuring code's version."""

    VERSION = "1"  # bump when format_errors changes what it measures

    def __init__(self, job, model, specs: dict, windows: torch.Tensor):
        from quantmla.methods.base import retired_config_hashes
        from quantmla.methods.prepare import config_sha, tensor_sha
        from quantmla.tracking.store import stable_hash

        self.retired = retired_config_hashes(job.paths.artifacts_dir)
        self.metadata = {
            "model": job.cfg.model.path,
            "model_config_hash": config_sha(model.config),
            "weights": str(job.weights),
            "candidates": [spec.key for spec in specs.values()],
            "protection": [job.policy.sink, job.policy.recent],
            "windows": tensor_sha(windows),
            "version": self.VERSION,
        }
        name = f"{stable_hash(self.metadata, 16)}.json"
        self.path = job.paths.artifacts_dir / "allocation" / name

    def load(self) -> dict[str, np.ndarray] | None:
        """This job's candidates' errors from its own file, else from a file measured over a
        superset of them (their columns, in this job's order); `self.path` names the file read."""
        import json

        from quantmla.methods.base import current_metadata

        wanted = self.metadata["candidates"]
        rest = {k: v for k, v in self.metadata.items() if k != "candidates"}
        others = sorted(p for p in self.path.parent.glob("*.json") if p != self.path)
        for path in [self.path, *others]:
            if not path.is_file():
                continue
            saved = json.loads(path.read_text())
            meta = current_metadata(saved.get("metadata", {}), self.retired)
            measured = meta.pop("candidates", [])
            if meta != rest or not set(wanted) <= set(measured):
                continue
            columns = [measured.index(key) for key in wanted]
            self.path = path
            print(f"[quantmla] mixed: the candidates' errors loaded from {path}")
            return {key: np.asarray(saved["errors"][key])[:, columns] for key in ERROR_KEYS}
        return None

    def save(self, errors: dict[str, np.ndarray]) -> None:
        from quantmla.tracking.store import write_atomic

        payload = {"metadata": self.metadata, "errors": {k: v.tolist() for k, v in errors.items()}}
        write_atomic(self.path, payload)
        print(f"[quantmla] mixed: the candidates' errors saved to {self.path}")


def layer_errors(job, measured: Measured, model, modules) -> tuple[np.ndarray, dict]:
    """(layers, candidates) predicted errors under `precision.allocation_error`, and its inputs."""
    p, m = job.cfg.precision, measured.errors
    if p.allocation_error == "response":
        rc, rp, cells = sensitivity_responses(job)
        if len(rc) != len(modules):
            raise ConfigError(
                "precision.sensitivity_experiment", p.sensitivity_experiment,
                f"records with {len(modules)} layers (they have {len(rc)})",
            )  # fmt: skip
        errors = predicted_errors(rc, rp, m["cache_content"], m["cache_rope"])
        return errors, dict(r_content=rc.tolist(), r_rope=rp.tolist(), sensitivity_cells=cells)
    if p.allocation_error == "output":  # each layer's measured output NMSE, the two paths' sum
        return m["output_content"] + m["output_rope"], {}
    # "loss": the output NMSE in nats of next-token KL, each layer's own propagation
    kl, probe_nmse, weights = loss_weights(model, modules, measured.windows)
    errors = weights[:, None] * (m["output_content"] + m["output_rope"])
    return errors, dict(
        loss_probe=LOSS_PROBE, probe_kl=kl.tolist(), probe_output_nmse=probe_nmse.tolist(),
        loss_weights=weights.tolist(),
    )  # fmt: skip


def choose(job, measured: Measured, errors, model, adapter, modules) -> tuple[Allocation, dict]:
    """The allocation with the least predicted error within the budget; with `joint_top` k > 1,
    of the k best the one whose whole run has the lowest next-token KL."""
    p, candidates = job.cfg.precision, measured.candidates
    sizes = format_bytes(candidates, measured.d_c, measured.d_r, p.group_size)
    best = best_allocations(errors, sizes, p.budget_bytes, candidates, p.joint_top)
    report = {"candidate_bytes": sizes.tolist()}
    if len(best) == 1:
        return best[0], report
    print(
        f"[quantmla] mixed: joint check of the {len(best)} best allocations ({p.allocation_error})"
    )
    # and for reference the uniform candidates that spend the budget best (C2R4 at its bytes)
    spend = sizes[sizes <= p.budget_bytes].max()
    uniform = [name for name, size in zip(candidates, sizes) if size == spend]
    shortlist = [a.precisions for a in best] + [(name,) * len(modules) for name in uniform]
    kl = joint_kl(model, adapter, modules, measured.results, shortlist, measured.windows)
    report.update(
        joint_allocations=[list(a.precisions) for a in best],
        joint_predicted=[a.predicted for a in best],
        joint_kl=kl[: len(best)].tolist(),
        joint_uniform={name: float(k) for name, k in zip(uniform, kl[len(best) :])},
    )
    return best[int(np.argmin(kl[: len(best)]))], report


def allocate_for_job(job, model, adapter, modules, tokenizer) -> tuple[Allocation, dict]:
    """The allocation of a `precision=mixed` job on its (BF16-patched, unfused) model, and what it
    used: measure every candidate, turn the measurements into errors, choose."""
    p = job.cfg.precision
    measured = measure_candidates(job, model, adapter, modules, tokenizer)
    errors, inputs = layer_errors(job, measured, model, modules)
    allocation, choice = choose(job, measured, errors, model, adapter, modules)
    print(
        f"[quantmla] mixed allocation at {p.budget_bytes:g} B/token: {', '.join(allocation.precisions)} "
        f"({allocation.bytes_per_token:g} B/token, predicted Σ error ({p.allocation_error}) {allocation.predicted:.3e})"
    )
    report = {
        "candidates": measured.candidates, "error_model": p.allocation_error,
        "measured_under": p.allocation_method, **inputs,
    }  # fmt: skip
    report.update(
        **choice,
        predicted_errors=errors.tolist(),
        nmse_windows=int(measured.windows.shape[0]),
        **({"errors_loaded_from": measured.loaded_from} if measured.loaded_from else {}),
        **{key: value.tolist() for key, value in measured.errors.items()},
    )
    return allocation, report
