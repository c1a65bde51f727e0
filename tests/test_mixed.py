"""`precision=mixed`: the allocation made in prepare from sensitivity records, each layer patched and
calibrated at its own format, the record carrying the choice; refusals before anything loads."""

import pytest

from quantmla.errors import ConfigError, DataNotFoundError
from tests.conftest import needs_tiny, run_config, tiny_job

SENSITIVITY = [
    "eval=sensitivity",
    "eval.n_sequences=1",
    "eval.seqlen=128",
    "experiment_name=sens",
    "precision=c4r4",
]
# tiny-mla: d_c 128, d_r 64 → C2R4 80 B/token, C4R4 112; the budget half way lets 3 of 6 layers take INT4
MIXED = [
    "precision=mixed",
    "precision.budget_bytes=96",
    "precision.candidates=[c2r4,c4r4]",
    "precision.sensitivity_experiment=sens",
    "precision.allocation_windows=1",
]
SMALL_QUANTMLA = [
    "method=quantmla",
    "method.calibration.n_calibration=4",
    "method.calibration.n_heldout=2",
    "method.calibration.seqlen=128",
    "method.calibration.steps=2",
    "method.calibration.select_every=1",
    "method.calibration.alphas=[0.0]",
]


@pytest.fixture(scope="module")
def sensitivity_store(tmp_path_factory):
    from quantmla.run import run

    root = tmp_path_factory.mktemp("mixed")
    run(run_config(*tiny_job(root, *SENSITIVITY)))
    return root


@needs_tiny
def test_mixed_job_allocates_patches_and_calibrates_each_layer(sensitivity_store):
    from quantmla.job import resolve
    from quantmla.prepare import prepare
    from quantmla.simulator import layer_patch

    prepared = prepare(resolve(run_config(*tiny_job(sensitivity_store, *MIXED, *SMALL_QUANTMLA))))
    m = prepared.metrics
    chosen = m["allocation/precisions"]
    # every layer is better at INT4, so the optimum spends the whole budget: 3 layers of each
    assert sorted(chosen) == ["c2r4"] * 3 + ["c4r4"] * 3
    assert m["allocation/bytes_per_token"] == m["cache/bytes_per_token"] == 96.0
    errors = m["allocation/predicted_errors"]
    index = {p: i for i, p in enumerate(m["allocation/candidates"])}
    assert m["allocation/predicted"] == pytest.approx(
        sum(errors[layer][index[p]] for layer, p in enumerate(chosen))
    )
    # the three INT4 layers are the three with the largest predicted INT2 → INT4 gain
    gains = [row[index["c2r4"]] - row[index["c4r4"]] for row in errors]
    best = sorted(range(6), key=gains.__getitem__)[3:]
    assert {i for i, p in enumerate(chosen) if p == "c4r4"} == set(best)
    assert [layer_patch(mod).policy.precision for mod in prepared.modules] == chosen
    assert prepared.method_result.metadata["precision"] == "mixed:" + ",".join(chosen)
    with prepared.unquantized():
        assert {layer_patch(mod).policy.precision for mod in prepared.modules} == {"bf16"}
    assert [layer_patch(mod).policy.precision for mod in prepared.modules] == chosen


@needs_tiny
def test_mixed_record_and_single_format_hashes(sensitivity_store):
    from quantmla.run import run

    record = run(run_config(*tiny_job(sensitivity_store, *MIXED)))
    assert record["config"]["precision"]["budget_bytes"] == 96
    assert len(record["metrics"]["allocation/precisions"]) == 6
    assert record["metrics"]["ppl/wikitext2"] > 1
    single = run(run_config(*tiny_job(sensitivity_store, "precision=c4r4")))
    # a single-format record's precision block is what it was before mixed existed (same hash)
    assert set(single["config"]["precision"]) == {"name", "sink", "recent", "group_size"}
    assert single["metrics"]["cache/bytes_per_token"] == 112


@needs_tiny
@pytest.mark.parametrize(
    ("overrides", "error", "named"),
    [
        (["precision.budget_bytes=null"], ConfigError, "precision.budget_bytes"),
        (["precision.budget_bytes=60"], ConfigError, ">= 80"),
        (["precision.candidates=[c4r4,c9r4]"], ConfigError, "c9r4"),
        (["precision.sensitivity_experiment=none"], DataNotFoundError, "sensitivity records"),
        (["eval=sensitivity"], ConfigError, "perplexity"),
    ],
)
def test_mixed_refusals_name_the_field(sensitivity_store, overrides, error, named):
    from quantmla.job import resolve

    with pytest.raises(error, match=named):
        resolve(run_config(*tiny_job(sensitivity_store, *MIXED, *overrides)))
