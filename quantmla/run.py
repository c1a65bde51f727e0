"""`python -m quantmla.run`: evaluate one (model, precision, method) and write its result record.

Validates the whole config first (no model is loaded for a bad one), skips the job if its record
already exists (unless force=true), measures WikiText-2/C4 perplexity of the quantized cache (and
of the unquantized model when eval.compare_bf16), prints a table and writes
`results/<experiment>/<config-hash>/result.json`.
"""

from __future__ import annotations

import sys
import time

import hydra
import torch
from omegaconf import OmegaConf

from quantmla.config import RunConfig, repo_root, resolve_model_path, validate
from quantmla.data import load_text, perplexity_windows, tokenize
from quantmla.errors import QuantMLAError
from quantmla.evaluation.nmse import OutputNMSE
from quantmla.evaluation.perplexity import perplexity
from quantmla.methods import apply_method, prepare_method
from quantmla.methods.equivalence import EquivalenceProbe
from quantmla.models.adapters import get_adapter
from quantmla.models.loading import load_pretrained
from quantmla.simulator import parse_precision, patch_model, set_policy
from quantmla.tracking.store import load_record, make_record, record_path, write_atomic
from quantmla.tracking.wandb_mirror import mirror


def format_table(record: dict) -> str:
    """Markdown table: the BF16 reference (if measured) and the job's precision × method."""
    cfg, metrics = record["config"], record["metrics"]
    if cfg["eval"]["kind"] == "memory":
        return "\n".join(f"| {k} | {v:.4g} |" for k, v in metrics.items())
    datasets = cfg["eval"]["datasets"]
    rows = []
    if any(k.startswith("bf16/") for k in metrics):
        rows.append(("bf16", "—", [metrics.get(f"bf16/ppl/{d}") for d in datasets], None))
    quantized = [metrics.get(f"ppl/{d}") for d in datasets]
    rows.append(
        (cfg["precision"]["name"], cfg["method"]["name"], quantized, metrics.get("nmse/attn_mean"))
    )
    lines = [
        "| precision | method | " + " | ".join(f"ppl/{d}" for d in datasets) + " | attn NMSE |",
        "|" + "---|" * (3 + len(datasets)),
    ]
    for precision, method, ppls, nmse in rows:
        cells = ["—" if v is None else f"{v:.3f}" for v in ppls] + [
            "—" if nmse is None else f"{nmse:.3e}"
        ]
        lines.append(f"| {precision} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluate(cfg: RunConfig) -> dict:
    """Load, prepare the method, fuse (checked), quantize, measure; returns the metrics dict."""
    model, tokenizer = load_pretrained(
        resolve_model_path(cfg.model.path),
        cfg.model.dtype,
        cfg.model.trust_remote_code,
        cfg.model.device,
    )
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    p = cfg.precision
    patch_model(model, "bf16", sink=p.sink, recent=p.recent, group_size=p.group_size)
    windows = {
        name: perplexity_windows(
            tokenize(load_text(name, cfg.eval.splits[name], cfg.data.data_dir), tokenizer),
            cfg.model.eval_seqlen,
            cfg.eval.max_windows,
        )
        for name in cfg.eval.datasets
    }
    metrics: dict = {f"windows/{name}": int(w.shape[0]) for name, w in windows.items()}

    def measure_perplexity(prefix: str, label: str) -> None:
        for name, w in windows.items():
            metrics[f"{prefix}ppl/{name}"] = perplexity(
                model, w, cfg.eval.batch_size, desc=f"{label} {name}"
            )

    if cfg.eval.compare_bf16:
        measure_perplexity("bf16/", "bf16")
    first = windows[cfg.eval.datasets[0]]
    reference = (
        OutputNMSE.capture(model, modules, first[: cfg.eval.nmse_windows])
        if cfg.eval.nmse_windows
        else None
    )

    started = time.time()
    result = prepare_method(cfg, model, adapter, tokenizer)
    metrics["method/seconds"] = time.time() - started
    if result is not None:
        probe = EquivalenceProbe(first[:2]).capture(model, modules)
        apply_method(model, adapter, result)
        metrics.update({f"equivalence/{k}": v for k, v in probe.check(model, modules).items()})
        if result.report:
            metrics["method/report"] = result.report
    set_policy(model, precision=p.name)
    measure_perplexity("", f"{p.name} {cfg.method.name}")
    if reference is not None:
        per_layer = reference.measure(modules)
        metrics["nmse/attn_layers"] = per_layer
        metrics["nmse/attn_mean"] = sum(per_layer) / len(per_layer)
    return metrics


def memory_metrics(cfg: RunConfig) -> dict:
    """Persistent cache bytes per layer and request (SPEC §6) for the job's precision."""
    from quantmla.memory import LAYOUTS, CacheLayout

    bits = parse_precision(cfg.precision.name)
    layout = CacheLayout(
        bits.content_bits,
        bits.rope_bits,
        sink=cfg.precision.sink,
        recent=cfg.precision.recent,
        group_size=cfg.precision.group_size,
    )
    lengths = cfg.eval.context_lengths or [2**k for k in range(10, 21)]
    metrics = {"memory/page_bytes": layout.page_bytes(), "memory/token_bytes": layout.token_bytes()}
    for n in lengths:
        metrics[f"memory/bytes@{n}"] = layout.persistent_bytes(n)
        metrics[f"memory/compression@{n}"] = LAYOUTS["bf16"].persistent_bytes(
            n
        ) / layout.persistent_bytes(n)
    return metrics


def run(cfg: RunConfig) -> dict | None:
    """One job: validate, skip if done, evaluate, record."""
    validate(cfg)
    if cfg.precision.name == "bf16" and cfg.method.name != "rtn":
        print(
            f"[quantmla] precision=bf16 quantizes nothing: method={cfg.method.name} skipped (the rtn job is BF16)"
        )
        return None
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    path = record_path(cfg.results_dir, cfg.experiment_name, config)
    existing = load_record(path)
    if existing is not None and not cfg.force:
        print(f"[quantmla] {path} exists: skipped (force=true recomputes)")
        print(format_table(existing))
        return existing
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    started = time.time()
    metrics = memory_metrics(cfg) if cfg.eval.kind == "memory" else evaluate(cfg)
    record = make_record(
        config, metrics, cfg.experiment_name, time.time() - started, repo=repo_root()
    )
    write_atomic(path, record)
    mirror(record, cfg.logger)
    print(format_table(record))
    print(f"[quantmla] wrote {path} ({record['wall_time_s']:.1f} s)")
    return record


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg) -> None:
    try:
        run(OmegaConf.to_object(cfg))
    except QuantMLAError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
