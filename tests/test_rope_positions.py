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
