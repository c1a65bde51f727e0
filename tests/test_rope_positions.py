"""The RoPE key's positional QK error by key position (eval=rope_positions): the suffix-Gram sum
against the dense score matrix in float64, and a job's record against that brute force on the
layer's own projections (QuaRot†'s online Hadamard included)."""

import pytest
import torch

from quantmla.evaluation.studies.rope_positions import bucket_edges, per_key_scored
from tests.conftest import needs_tiny, run_config, tiny_job


def dense_per_key(q, x):
    scores = torch.einsum("bhtr,bjr->bhtj", q, x)
    causal = torch.ones(q.shape[2], x.shape[1], dtype=torch.bool).tril()
    return scores.pow(2).masked_fill(~causal, 0).sum((1, 2))  # over heads and queries t ≥ j


def test_per_key_sum_equals_the_dense_causal_scores():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64)
    x = torch.randn(2, 37, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(per_key_scored(q, x), dense_per_key(q, x), rtol=1e-12, atol=1e-12)
    assert bucket_edges(2048) == [0, 512, 1024, 1536, 2048]


@needs_tiny
@pytest.mark.parametrize("method", ["rtn", "quarot"])
def test_record_equals_brute_force_on_the_layer_projections(tmp_path, method):
    from quantmla.evaluation.studies.layer_study import capture_cell, cell_sequences, layer_cell
    from quantmla.job import resolve
    from quantmla.prepare import prepare
    from quantmla.quant import qdq_rope
    from quantmla.run import run
    from quantmla.simulator import layer_patch
    from quantmla.transforms import hadamard

    overrides = tiny_job(
        tmp_path, "eval=rope_positions", "eval.n_sequences=2", "eval.seqlen=64", "eval.layers=[1]",
        "precision.name=c16r4", f"method={method}",
    )  # fmt: skip
    record = run(run_config(*overrides))
    m = record["metrics"]
    assert m["rope_positions/edges"] == [0, 16, 32, 48, 64] and m["rope_positions/layers"] == [1]

    cfg = run_config(*overrides)
    prepared = prepare(resolve(cfg))
    with prepared.unquantized():
        store = capture_cell(prepared.model, prepared.modules, cell_sequences(cfg, prepared), 1)
    module = prepared.modules[1]
    cell = layer_cell(store, 1, module, prepared.adapter)
    q, k = cell.proj.q_rot.double(), cell.proj.k_rot.double()
    assert (layer_patch(module).rope_online is not None) == (method == "quarot")
    if method == "quarot":
        h = hadamard(k.shape[-1]).double()
        q, k = q @ h, k @ h
    error = dense_per_key(q, qdq_rope(prepared.policy.spec, k) - k).sum(0)
    energy = dense_per_key(q, k).sum(0)
    expected = [float(error[a : a + 16].sum() / energy[a : a + 16].sum()) for a in (0, 16, 32, 48)]
    assert m["rope_positions/qk_error"][0] == pytest.approx(expected, rel=1e-9)
    assert all(x > 0 for x in expected)


def small_context(config_fn):
    from transformers import AutoModelForCausalLM

    from quantmla.calibration.context import CalibrationContext
    from quantmla.models.adapters import get_adapter
    from quantmla.models.capture import capture_inputs

    torch.manual_seed(0)
    dims = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64)
    model = AutoModelForCausalLM.from_config(config_fn(vocab_size=128, **dims)).eval()
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    sequences = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    store = capture_inputs(model, modules, sequences, batch_size=2)
    return CalibrationContext(model, adapter, modules, store, torch.arange(2), torch.arange(0))


@pytest.mark.parametrize("family", ["v3_interleave", "v2"])
def test_shifted_projections_are_those_of_the_later_positions(family):
    """`rope_positions`' shift: each sequence's RoPE query and key as the model's own RoPE gives
    them `offset` positions later (V3 with interleaved weights and half-split cache pairs; V2
    interleaved throughout), every QK score unchanged."""
    from quantmla.models.tiny import tiny_mla_config, tiny_mla_v2_config

    ctx = small_context(tiny_mla_config if family == "v3_interleave" else tiny_mla_v2_config)
    layer, offsets = 1, torch.tensor([7, 1000])
    proj, _ = ctx.project(layer, torch.arange(2), teacher=False)
    moved = ctx.shifted(layer, proj, offsets)
    h = ctx.store.inputs[layer]
    for i, start in enumerate(offsets.tolist()):
        positions = torch.arange(start, start + h.shape[1])[None]
        later = ctx.adapter.project(
            ctx.modules[layer], h[i : i + 1], ctx.model.model.rotary_emb(h[i : i + 1], positions)
        )
        torch.testing.assert_close(moved.k_rot[i], later.k_rot[0], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(moved.q_rot[i], later.q_rot[0], atol=2e-4, rtol=1e-4)
    assert not torch.allclose(moved.k_rot, proj.k_rot, atol=1e-2)

    def scores(p):
        return p.q_rot @ p.k_rot[:, None].transpose(-1, -2)

    torch.testing.assert_close(scores(moved), scores(proj), atol=1e-5, rtol=1e-5)
