import copy

import pytest
import torch
import torch.nn.functional as F

from experiments.rotation_diagnosis import (
    RULES,
    attention_probabilities,
    band_score,
    layer_report,
    oracle_perplexity,
    query_sum,
    rule_threshold,
    write_score,
)
from quantmla.quant import qdq_content
from quantmla.spec import QuantizerSpec
from quantmla.transforms import hadamard, latent_magnitude
from tests.conftest import needs_tiny, run_config, tiny_job

SINK, RECENT, PROTECT = 2, 5, 3


def per_query_nmse(module, adapter, proj, latent_hat, exact_keys) -> float:
    """float64, one query at a time, by the expanded form: key t is read as `latent_hat[t]` unless
    `exact_keys(i, t)`; NMSE of the post-o_proj output against every key exact."""
    w = module.kv_b_proj.weight.double()
    w_o = module.o_proj.weight.double()
    g = adapter.geometry(module)
    q = torch.cat([proj.q_nope[0], proj.q_rot[0]], -1).double()  # (H, n, d_nope + d_r)
    c, c_hat, k_rot = proj.c[0].double(), latent_hat.double(), proj.k_rot[0].double()
    err = ref = 0.0
    for i in range(c.shape[0]):
        outs = []
        for latent in (
            c[: i + 1],
            torch.stack([c[t] if exact_keys(i, t) else c_hat[t] for t in range(i + 1)]),
        ):
            kv = F.linear(latent, w).view(i + 1, g.n_heads, -1).transpose(0, 1)
            k = torch.cat([kv[..., : g.d_nope], k_rot[: i + 1].expand(g.n_heads, -1, -1)], -1)
            p = (q[:, i : i + 1] @ k.transpose(1, 2) * g.scaling).softmax(-1)
            outs.append((p @ kv[..., g.d_nope :]).flatten() @ w_o.T)
        err += float((outs[1] - outs[0]).pow(2).sum())
        ref += float(outs[0].pow(2).sum())
    return err / ref


def query_probabilities(module, adapter, proj, i: int) -> torch.Tensor:
    """(H, i + 1) float64 attention probabilities of query i over keys 0..i, one query alone."""
    w_uk, _ = adapter.up_projections(module)
    s = torch.einsum("hd,hdc,tc->ht", proj.q_nope[0, :, i], w_uk, proj.c[0, : i + 1])
    s = s + proj.q_rot[0, :, i] @ proj.k_rot[0, : i + 1].T
    return (s.double() * adapter.geometry(module).scaling).softmax(-1)


@pytest.mark.parametrize("precision", ["cnvfp4r16", "c2r16"])
def test_layer_report_matches_a_per_query_float64_reference(ctx, precision):
    module = copy.deepcopy(ctx.modules[0])
    adapter, spec = ctx.adapter, QuantizerSpec.from_precision(precision)
    hidden, pe = ctx.store.inputs[0][:1], ctx.store.position_embeddings[0]
    with torch.no_grad():
        proj = adapter.project(module, hidden, pe)
        row = layer_report(copy.deepcopy(module), adapter, hidden, pe, spec, SINK, RECENT, PROTECT)
        # BF16 attention mass per key, by brute force: the protected tokens are its largest past the sinks
        mass = torch.zeros(hidden.shape[1], dtype=torch.float64)
        for i in range(hidden.shape[1]):
            mass[: i + 1] += query_probabilities(module, adapter, proj, i).sum(0)
        top = set((mass[SINK:].topk(PROTECT).indices + SINK).tolist())
        assert row["sink_mass"] == pytest.approx(float(mass[:SINK].sum() / mass.sum()), rel=1e-5)
        assert row["top_mass"] == pytest.approx(
            float(mass[sorted(top)].sum() / mass.sum()), rel=1e-5
        )

        gamma = module.kv_a_layernorm.weight.double()
        h, m = hadamard(proj.c.shape[-1]), latent_magnitude(gamma)
        rotated = (proj.c[0].double() / gamma) @ h * m  # what QuaRot†'s fused cache holds
        hats = {
            "rtn": qdq_content(spec, proj.c[0]),
            "hadamard": qdq_content(spec, rotated) / m @ h.T * gamma,
        }

        def policy(i, t):
            return t < SINK or i - t < RECENT

        for name, c_hat in hats.items():
            expected = per_query_nmse(module, adapter, proj, c_hat, policy)
            kept = per_query_nmse(
                module, adapter, proj, c_hat, lambda i, t: policy(i, t) or t in top
            )
            assert 0 < kept < expected
            assert row[name] == pytest.approx(expected, rel=2e-3)
            assert row[f"{name}_kept"] == pytest.approx(kept, rel=2e-3)


@needs_tiny
def test_oracle_perplexity_is_the_simulators_and_bf16_with_every_token_exact(tmp_path):
    """The oracle's forward under the policy reproduces `quantmla.run`'s perplexity (the simulator),
    with no key quantized its BF16 perplexity; protecting every token past the sinks is BF16."""
    from quantmla.policy import CachePolicy
    from quantmla.run import run

    overrides = tiny_job(tmp_path, "precision=c2r4")
    every = run_config(*overrides).model.eval_seqlen - CachePolicy.sink
    ppl = oracle_perplexity(overrides, windows=1, protect=every)
    bf16, c2r4 = (
        run(run_config(*tiny_job(tmp_path, f"precision={p}")))["metrics"]["ppl/wikitext2"]
        for p in ("bf16", "c2r4")
    )
    assert ppl["BF16"] == pytest.approx(bf16, rel=1e-5)
    assert ppl["policy"] == pytest.approx(c2r4, rel=1e-5)
    assert ppl["policy"] > 1.001 * bf16
    assert ppl[f"+ top {every}"] == pytest.approx(bf16, rel=1e-5)
    for name in RULES:  # each threshold keeps every token
        assert ppl[f"+ {name}"] == pytest.approx(bf16, rel=1e-5)


def test_write_score_is_the_mean_querys_logit_by_the_expanded_form(ctx):
    """The rule's score of key j: logsumexp over heads of the mean over queries t of
    q_nope[h, t]·k_nope[h, j], k_nope from kv_b_proj (float64); its threshold keeps its fraction."""
    module, adapter = ctx.modules[0], ctx.adapter
    with torch.no_grad():
        proj = adapter.project(module, ctx.store.inputs[0][:1], ctx.store.position_embeddings[0])
        g = adapter.geometry(module)
        n = proj.c.shape[1]
        mean_query = query_sum(module, adapter, proj) / n
        score = write_score(module, adapter, proj.c[0], mean_query)
    kv = F.linear(proj.c[0].double(), module.kv_b_proj.weight.double()).view(n, g.n_heads, -1)
    logits = torch.einsum("htd,jhd->hj", proj.q_nope[0].double(), kv[..., : g.d_nope]) / n
    expected = (logits * g.scaling).logsumexp(0)
    assert torch.allclose(score.double(), expected, rtol=1e-4, atol=1e-5)
    threshold = rule_threshold(score, 0.25)
    assert int((score > threshold).sum()) == pytest.approx(0.25 * n, abs=1)
    assert rule_threshold(score, 1.0) == float("-inf")


def test_band_score_by_brute_force(ctx):
    """The band rule's score of key j, one query at a time in float64: the mean over heads of
    p(i, j) × (i + 1) summed over the queries i that read j inside the recent band."""
    module, adapter = ctx.modules[0], ctx.adapter
    with torch.no_grad():
        proj = adapter.project(module, ctx.store.inputs[0][:1], ctx.store.position_embeddings[0])
        score = band_score(attention_probabilities(module, adapter, proj), RECENT)
    n = proj.c.shape[1]
    expected = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        with torch.no_grad():
            p = query_probabilities(module, adapter, proj, i)
        for j in range(max(0, i - RECENT + 1), i + 1):
            expected[j] += float(p[:, j].mean()) * (i + 1)
    assert torch.allclose(score.double(), expected, rtol=1e-4, atol=1e-6)
