"""Why QuaRot†'s Hadamard raises a latent format's attention-output error in some layers (#40).

`python -m experiments.rotation_diagnosis --model checkpoints/smol-mla --precision cnvfp4r16`
quantizes each layer's content latent alone (teacher-forced: every layer's clean inputs, the RoPE
key exact, the policy's sinks and recent band exact) as the cache stores it without a transform
(RTN) and after QuaRot†'s fused Hadamard, and prints per layer the attention-output NMSE of both;
who receives the attention past the sinks (the `--protect` tokens with the most BF16 attention
mass: their share, the share of their latent's energy in its 4 largest channels, their value
vectors' size against their latent's, each over the window's median token); and both NMSEs again
with those tokens read exact as well — where the Hadamard's excess goes with them, it was theirs."""

from __future__ import annotations

import argparse
from collections import Counter
from types import SimpleNamespace

import torch

HEAVY_CHANNELS = 4  # a latent's energy share in its largest channels: how concentrated it is


def layer_report(module, adapter, hidden, position_embeddings, spec, sink, recent, protect):
    """One layer's row: attention mass and the protected tokens' latents (unfused weights), then
    the content latent's output NMSE unfused (RTN) and with QuaRot†'s Hadamard fused, each with
    the policy's protection and with the top-`protect` tokens exact too. Fuses the module."""
    from quantmla.attention import attention_output, causal_regions, protected_mask
    from quantmla.methods.quarot import quarot
    from quantmla.metrics import nmse
    from quantmla.quant import qdq_content
    from quantmla.transforms import fuse_content

    geometry = adapter.geometry(module)
    proj = adapter.project(module, hidden, position_embeddings)
    n = hidden.shape[1]
    w_uk, w_uv = adapter.up_projections(module)
    scores = torch.einsum("hnd,hdc,tc->hnt", proj.q_nope[0], w_uk, proj.c[0])
    scores = (scores + proj.q_rot[0] @ proj.k_rot[0].T) * geometry.scaling
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mass = scores.masked_fill(~causal, float("-inf")).softmax(-1).sum((0, 1))
    top = mass[sink:].topk(protect).indices + sink
    c = proj.c[0]
    heavy = c.pow(2).topk(HEAVY_CHANNELS, dim=-1).values.sum(-1) / c.pow(2).sum(-1)
    value_gain = torch.einsum("hvc,tc->thv", w_uv, c).flatten(1).norm(dim=-1) / c.norm(dim=-1)
    row = {
        "sink_mass": float(mass[:sink].sum() / mass.sum()),
        "top_mass": float(mass[top].sum() / mass.sum()),
        "top_heavy": float(heavy[top].mean() / heavy.median()),
        "top_value_gain": float(value_gain[top].mean() / value_gain.median()),
        "top": top.tolist(),
    }
    exact = protected_mask(torch.arange(n), n, sink, recent) & causal
    kept = exact.clone()
    kept[:, top] = causal[:, top]

    def output_errors(proj) -> list[float]:
        """The output NMSE with the policy's exact keys, then with the top tokens exact too."""
        reference = attention_output(
            module, adapter, proj.q_nope, proj.q_rot, causal_regions(proj.c, proj.k_rot)
        )
        c_hat = qdq_content(spec, proj.c)
        errors = []
        for read_exact in (exact, kept):
            regions = [(c_hat, proj.k_rot, (causal & ~read_exact)[None, None]),
                       (proj.c, proj.k_rot, read_exact[None, None])]  # fmt: skip
            out = attention_output(module, adapter, proj.q_nope, proj.q_rot, regions)
            errors.append(float(nmse(out, reference)))
        return errors

    row["rtn"], row["rtn_kept"] = output_errors(proj)
    hadamard = quarot(SimpleNamespace(modules=[module])).layers[0].content
    fuse_content(module, adapter, hadamard)
    row["hadamard"], row["hadamard_kept"] = output_errors(
        adapter.project(module, hidden, position_embeddings)
    )
    return row


def main(argv: list[str] | None = None) -> None:
    from experiments.smol_mla import DATA_DIR
    from quantmla.data import load_text, tokenize
    from quantmla.models.adapters import get_adapter
    from quantmla.models.capture import capture_inputs
    from quantmla.models.loading import load_pretrained
    from quantmla.policy import CachePolicy
    from quantmla.spec import QuantizerSpec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local checkpoint folder or hub id")
    parser.add_argument("--precision", default="cnvfp4r16", help="the content format (cXr16)")
    parser.add_argument("--length", type=int, default=2048, help="tokens of WikiText-2 test")
    parser.add_argument("--protect", type=int, default=64, help="top-attention tokens read exact")
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--layers", default=None, help="comma-separated layer indices (all)")
    parser.add_argument("--sink", type=int, default=CachePolicy.sink)
    parser.add_argument("--recent", type=int, default=CachePolicy.recent)
    args = parser.parse_args(argv)
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
    with torch.no_grad():
        for i, module in enumerate(modules):
            if args.layers is not None and i not in {int(x) for x in args.layers.split(",")}:
                continue
            r = layer_report(
                module, adapter, store.inputs[i], store.position_embeddings[i], spec,
                args.sink, args.recent, args.protect,
            )  # fmt: skip
            token, count = Counter(ids[0, r["top"]].tolist()).most_common(1)[0]
            print(
                f"{i:5d} | {r['sink_mass']:.2f} | {r['top_mass']:.2f}, {r['top_heavy']:.2f}x, "
                f"{r['top_value_gain']:.2f}x, {tokenizer.decode([token])!r} {count} | "
                f"{r['rtn']:.2e}, {r['hadamard']:.2e} ({r['hadamard'] / r['rtn']:.2f}x) | {r['rtn_kept']:.2e}, {r['hadamard_kept']:.2e} "
                f"({r['hadamard_kept'] / r['rtn_kept']:.2f}x)"
            )


if __name__ == "__main__":
    main()
