"""Who the attention reads past the sinks, and how much of a cache's error is theirs (#40).

`python -m experiments.rotation_diagnosis --model checkpoints/smol-mla --precision cnvfp4r16`
quantizes each layer's content latent alone (teacher-forced: every layer's clean inputs, the RoPE
key exact, the policy's sinks and recent band exact) as the cache stores it without a transform
(RTN) and after QuaRot†'s fused Hadamard, and prints per layer the attention-output NMSE of both;
who receives the attention past the sinks (the `--protect` tokens with the most BF16 attention
mass: their share, the share of their latent's energy in its 4 largest channels, their value
vectors' size against their latent's, each over the window's median token); and both NMSEs again
with those tokens read exact as well — where the Hadamard's excess goes with them, it was theirs.

`python -m experiments.rotation_diagnosis --perplexity 2 experiment=smol_table1 model=smol_mla
precision=c2r4 method=quantmla` prepares the run those Hydra overrides name (its method's
artifact loaded, as `quantmla.run` does) and prints the perplexity of the first windows in BF16,
under the policy, with each layer's top `--protect` tokens exact too (chosen from that layer's own
BF16 attention: an oracle, no rule that a cache could run), and with the tokens that one of two
rules a cache could run picks exact instead: `aligned`, when a token is written, whether its latent
draws the layer's mean absorbed query; `band`, when it leaves the recent band, whether it drew more
attention than most while the band's queries read it exact. Both are calibrated on the methods'
calibration text, thresholds included (each keeps the oracle's share of the tokens)."""

from __future__ import annotations

import argparse
import math
from collections import Counter
from functools import partial
from types import SimpleNamespace

import torch

HEAVY_CHANNELS = 4  # a latent's energy share in its largest channels: how concentrated it is


def attention_probabilities(module, adapter, proj) -> torch.Tensor:
    """(H, n, n) BF16 causal attention probabilities of each head, query and key."""
    w_uk, _ = adapter.up_projections(module)
    scores = torch.einsum("hnd,hdc,tc->hnt", proj.q_nope[0], w_uk, proj.c[0])
    scores = (scores + proj.q_rot[0] @ proj.k_rot[0].T) * adapter.geometry(module).scaling
    n = scores.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def top_tokens(probabilities: torch.Tensor, sink: int, k: int) -> torch.Tensor:
    """The `k` tokens past the sinks that receive the most attention (summed over queries, heads)."""
    return probabilities.sum((0, 1))[sink:].topk(k).indices + sink


def exact_reads(n: int, sink: int, recent: int, top: torch.Tensor | None = None) -> torch.Tensor:
    """(n, n) bool: query i reads key j exact (the policy's sinks and recent band, and `top`)."""
    from quantmla.attention import protected_mask

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    exact = protected_mask(torch.arange(n), n, sink, recent) & causal
    if top is not None:
        exact[:, top] = causal[:, top]
    return exact


def read_through_cache(module, adapter, proj, c_hat, k_hat, exact) -> torch.Tensor:
    """The post-o_proj attention output when the keys `exact` marks are read as written and the
    others as the cache's copies (`c_hat`, `k_hat`)."""
    from quantmla.attention import attention_output

    causal = torch.ones_like(exact).tril()
    regions = [(c_hat, k_hat, (causal & ~exact)[None, None]),
               (proj.c, proj.k_rot, exact[None, None])]  # fmt: skip
    regions = [r for r in regions if r[2].any()]  # an empty region would only double the keys
    return attention_output(module, adapter, proj.q_nope, proj.q_rot, regions)


def layer_report(module, adapter, hidden, position_embeddings, spec, sink, recent, protect):
    """One layer's row: attention mass and the protected tokens' latents (unfused weights), then
    the content latent's output NMSE unfused (RTN) and with QuaRot†'s Hadamard fused, each with
    the policy's protection and with the top-`protect` tokens exact too. Fuses the module."""
    from quantmla.methods.quarot import quarot
    from quantmla.metrics import nmse
    from quantmla.quant import qdq_content
    from quantmla.transforms import fuse_content

    proj = adapter.project(module, hidden, position_embeddings)
    n = hidden.shape[1]
    probabilities = attention_probabilities(module, adapter, proj)
    mass = probabilities.sum((0, 1))  # the BF16 attention each token receives
    top = top_tokens(probabilities, sink, protect)
    c = proj.c[0]
    heavy = c.pow(2).topk(HEAVY_CHANNELS, dim=-1).values.sum(-1) / c.pow(2).sum(-1)
    _, w_uv = adapter.up_projections(module)
    value_gain = torch.einsum("hvc,tc->thv", w_uv, c).flatten(1).norm(dim=-1) / c.norm(dim=-1)
    row = {
        "sink_mass": float(mass[:sink].sum() / mass.sum()),
        "top_mass": float(mass[top].sum() / mass.sum()),
        "top_heavy": float(heavy[top].mean() / heavy.median()),
        "top_value_gain": float(value_gain[top].mean() / value_gain.median()),
        "top": top.tolist(),
    }

    def output_errors(proj) -> list[float]:
        """The output NMSE with the policy's exact keys, then with the top tokens exact too."""
        reference = read_through_cache(
            module, adapter, proj, proj.c, proj.k_rot, exact_reads(n, n, 0)
        )
        c_hat = qdq_content(spec, proj.c)
        return [
            float(
                nmse(read_through_cache(module, adapter, proj, c_hat, proj.k_rot, exact), reference)
            )
            for exact in (exact_reads(n, sink, recent), exact_reads(n, sink, recent, top))
        ]

    row["rtn"], row["rtn_kept"] = output_errors(proj)
    hadamard = quarot(SimpleNamespace(modules=[module])).layers[0].content
    fuse_content(module, adapter, hadamard)
    row["hadamard"], row["hadamard_kept"] = output_errors(
        adapter.project(module, hidden, position_embeddings)
    )
    return row


def query_sum(module, adapter, proj) -> torch.Tensor:
    """(H, d_c) the window's absorbed content queries (q_nope·W_UK) summed over its tokens."""
    w_uk, _ = adapter.up_projections(module)
    return torch.einsum("hnd,hdc->hc", proj.q_nope[0], w_uk)


def write_score(module, adapter, c, mean_query) -> torch.Tensor:
    """(n,) how strongly each latent draws an average query: the logsumexp over heads of its content
    logit against the layer's mean absorbed query — known when the token is written."""
    return (c @ mean_query.T * adapter.geometry(module).scaling).logsumexp(-1)


def band_score(probabilities: torch.Tensor, recent: int) -> torch.Tensor:
    """(n,) the attention each token receives while it is in the recent band (from itself and the
    next `recent` − 1 queries), each query's probability × the keys it reads (1 = uniform), mean
    over heads — known when the token leaves the band, before any query reads it quantized."""
    n = probabilities.shape[-1]
    i = torch.arange(n)
    lag = i[:, None] - i[None, :]
    relative = probabilities.mean(0) * (i + 1)[:, None]
    return (relative * ((lag >= 0) & (lag < recent))).sum(0)


RULES = ("aligned", "band")  # the deployable rules the perplexity mode sets beside the oracle


def rule_score(name, module, adapter, proj, probabilities, state, recent) -> torch.Tensor:
    """(n,) rule `name`'s score of each token of the window `proj` projects (`probabilities`:
    its BF16 attention)."""
    if name == "aligned":
        return write_score(module, adapter, proj.c[0], state["query_sum"] / state["tokens"])
    return band_score(probabilities, recent)


def rule_threshold(scores: torch.Tensor, fraction: float) -> float:
    """The score that `fraction` of the calibration tokens exceed (−inf: every token)."""
    return float("-inf") if fraction >= 1 else float(scores.double().quantile(1 - fraction))


def oracle_forward(module, adapter, spec, sink, recent, reading, state, hidden_states, position_embeddings=None, **_):  # fmt: skip
    """A patched MLA module's forward for one unpadded sequence without a cache. `reading["mode"]`:
    "bf16" (every key exact), "policy", "oracle" (the layer's top `reading["protect"]` tokens by
    BF16 attention exact too), a name in `RULES` (the tokens whose score passes the layer's
    threshold exact too; their count and recall of the oracle's tokens kept in `state`);
    "mean_query" and "scores" read every key exact while they calibrate the layer's rules.
    The band rule's score reads BF16 probabilities: in a cache the band's keys are exact but older
    ones are not, which moves each query's softmax normaliser a little."""
    from quantmla.quant import qdq_content, qdq_rope
    from quantmla.simulator import layer_patch

    proj = adapter.project(module, hidden_states, position_embeddings)
    online = layer_patch(module).rope_online  # QuaRot†'s post-RoPE Hadamard
    if online is not None:
        proj.q_rot, proj.k_rot = proj.q_rot @ online, proj.k_rot @ online
    n, mode = hidden_states.shape[1], reading["mode"]
    c_hat, k_hat, exact = proj.c, proj.k_rot, exact_reads(n, n, 0)
    if mode == "mean_query":
        state["query_sum"] = state.get("query_sum", 0) + query_sum(module, adapter, proj)
        state["tokens"] = state.get("tokens", 0) + n
    elif mode == "scores":
        probabilities = attention_probabilities(module, adapter, proj)
        for name in RULES:
            score = rule_score(name, module, adapter, proj, probabilities, state, recent)
            state["scores"][name].append(score[sink:])
    elif mode != "bf16":
        top = None
        if mode != "policy":  # the oracle, or a rule measured against it
            probabilities = attention_probabilities(module, adapter, proj)
            top = oracle = top_tokens(probabilities, sink, reading["protect"])
        if mode in RULES:
            score = rule_score(mode, module, adapter, proj, probabilities, state, recent)
            top = (score[sink:] > state["threshold"][mode]).nonzero().flatten() + sink
            state["picked"][mode].append(top.numel())
            state["recall"][mode].append(float(torch.isin(oracle, top).double().mean()))
        c_hat, k_hat = qdq_content(spec, proj.c), qdq_rope(spec, proj.k_rot)
        exact = exact_reads(n, sink, recent, top)
    return read_through_cache(module, adapter, proj, c_hat, k_hat, exact), None


def oracle_perplexity(
    overrides: list[str], windows: int, protect: int, calibration_windows: int = 2
) -> dict[str, float]:
    """The first `windows` WikiText-2 test windows' perplexity of the run `overrides` name: BF16,
    under the policy, with each layer's top `protect` tokens exact too, and with each rule's tokens
    exact instead (calibrated on the first `calibration_windows` windows of the methods'
    calibration text to keep `protect` of a window's tokens past the sinks)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from quantmla.config import CalibrationConfig  # (importing it registers the schemas)
    from quantmla.data import load_text, perplexity_windows, tokenize
    from quantmla.evaluation.perplexity import window_nll
    from quantmla.job import resolve
    from quantmla.paths import repo_root
    from quantmla.prepare import prepare

    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides=overrides))
    prepared = prepare(resolve(cfg))
    policy, reading = prepared.policy, {"protect": protect}
    states = [{k: {name: [] for name in RULES} for k in ("scores", "picked", "recall")}
              for _ in prepared.modules]  # fmt: skip
    for module, state in zip(prepared.modules, states):
        module.forward = partial(
            oracle_forward,
            module,
            prepared.adapter,
            policy.spec,
            policy.sink,
            policy.recent,
            reading,
            state,
        )

    def split(dataset: str, name: str, count: int) -> torch.Tensor:
        ids = tokenize(load_text(dataset, name, prepared.paths.data_dir), prepared.tokenizer)
        return perplexity_windows(ids, cfg.model.eval_seqlen, count)

    cal = cfg.method.calibration or CalibrationConfig()  # the methods' text, never the test set
    calibration = split(cal.dataset, cal.split, calibration_windows)
    for mode in ("mean_query", "scores"):
        reading["mode"] = mode
        window_nll(prepared.model, calibration, batch_size=1, desc=mode)
    fraction = protect / (cfg.model.eval_seqlen - policy.sink)
    for state in states:
        scores = state.pop("scores")
        state["threshold"] = {
            name: rule_threshold(torch.cat(scores[name]), fraction) for name in RULES
        }
    ids = split("wikitext2", "test", windows)
    print(f"{' '.join(overrides)}: {ids.shape[0]} WikiText-2 test windows of {ids.shape[1]} tokens")
    ppl = {}
    modes = [("BF16", "bf16"), ("policy", "policy"), (f"+ top {protect}", "oracle")]
    for label, mode in modes + [(f"+ {name}", name) for name in RULES]:
        reading["mode"] = mode
        ppl[label] = math.exp(
            float(window_nll(prepared.model, ids, batch_size=1, desc=label).mean())
        )
        print(
            f"{label:>10}: {ppl[label]:.3f} ({100 * (ppl[label] / ppl['BF16'] - 1):+.2f} %)",
            flush=True,
        )
    for i, state in enumerate(states):
        print(
            f"layer {i:2d}: of the oracle's top {protect} a window, "
            + ", ".join(
                f"{name} keeps {sum(state['picked'][name]) / len(state['picked'][name]):.0f} "
                f"and finds {sum(state['recall'][name]) / len(state['recall'][name]):.0%}"
                for name in RULES
            )
        )
    return ppl


def main(argv: list[str] | None = None) -> None:
    from experiments.smol_mla import DATA_DIR
    from quantmla.data import load_text, tokenize
    from quantmla.models.adapters import get_adapter
    from quantmla.models.capture import capture_inputs
    from quantmla.models.loading import load_pretrained
    from quantmla.policy import CachePolicy
    from quantmla.spec import QuantizerSpec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local checkpoint folder or hub id (the per-layer table)")
    parser.add_argument("--precision", default="cnvfp4r16", help="the content format (cXr16)")
    parser.add_argument("--length", type=int, default=2048, help="tokens of WikiText-2 test")
    parser.add_argument("--protect", type=int, default=64, help="top-attention tokens read exact")
    parser.add_argument("--layers", default=None, help="comma-separated layer indices (all)")
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--sink", type=int, default=CachePolicy.sink)
    parser.add_argument("--recent", type=int, default=CachePolicy.recent)
    parser.add_argument("--perplexity", type=int, default=0, help="windows: the perplexity mode")
    parser.add_argument("--calibration-windows", type=int, default=2, help="the rule's windows")
    parser.add_argument("overrides", nargs="*", help="--perplexity: the run's Hydra overrides")
    args = parser.parse_args(argv)
    if args.perplexity:
        oracle_perplexity(args.overrides, args.perplexity, args.protect, args.calibration_windows)
        return
    if args.model is None or args.overrides:
        parser.error("the per-layer table takes --model and no Hydra overrides")
    spec = QuantizerSpec.from_precision(args.precision)
    model, tokenizer = load_pretrained(args.model, "float32")
    ids = tokenize(load_text("wikitext2", "test", args.data_dir), tokenizer)[None, : args.length]
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    store = capture_inputs(model, modules, ids, batch_size=1)
    print(
        f"{args.precision} content latent alone, {ids.shape[1]} tokens, sinks {args.sink}, recent "
        f"{args.recent}; top {args.protect}: the tokens with the most attention past the sinks"
    )
    print(
        "layer | sinks' mass | top: mass, heavy, ‖v‖/‖c‖, commonest token | "
        "NMSE RTN, Hadamard (x) | top exact: RTN, Hadamard (x)"
    )
    layers = range(len(modules)) if args.layers is None else map(int, args.layers.split(","))
    with torch.no_grad():
        for i in layers:
            r = layer_report(
                modules[i], adapter, store.inputs[i], store.position_embeddings[i], spec,
                args.sink, args.recent, args.protect,
            )  # fmt: skip
            token, count = Counter(ids[0, r["top"]].tolist()).most_common(1)[0]
            print(
                f"{i:5d} | {r['sink_mass']:.2f} | {r['top_mass']:.2f}, {r['top_heavy']:.2f}x, "
                f"{r['top_value_gain']:.2f}x, {tokenizer.decode([token])!r} {count} | "
                f"{r['rtn']:.2e}, {r['hadamard']:.2e} ({r['hadamard'] / r['rtn']:.2f}x) | "
                f"{r['rtn_kept']:.2e}, {r['hadamard_kept']:.2e} "
                f"({r['hadamard_kept'] / r['rtn_kept']:.2f}x)"
            )


if __name__ == "__main__":
    main()
