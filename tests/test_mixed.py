"""`precision=mixed`: the allocation made in prepare from sensitivity records, each layer patched and
calibrated at its own format, the record carrying the choice; refusals before anything loads."""

import numpy as np
import pytest
import torch

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

    job = resolve(run_config(*tiny_job(sensitivity_store, *MIXED, *SMALL_QUANTMLA)))
    prepared = prepare(job)
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
    # layers calibrate independently: each layer's transforms are its candidate format's (whose
    # artifacts the allocation calibrated and kept)
    from quantmla.mixed import candidate_results

    specs = {p: prepared.policy.layer(p).spec for p in ("c2r4", "c4r4")}
    uniform = candidate_results(
        job, prepared.model, prepared.adapter, prepared.modules, prepared.tokenizer, specs
    )
    for layer, p in enumerate(chosen):
        got, want = prepared.method_result.layers[layer], uniform[p].layers[layer]
        assert torch.equal(got.content.rotation, want.content.rotation)
        assert torch.equal(got.rope.angles, want.rope.angles)
    with prepared.unquantized():
        assert {layer_patch(mod).policy.precision for mod in prepared.modules} == {"bf16"}
    assert [layer_patch(mod).policy.precision for mod in prepared.modules] == chosen


@needs_tiny
def test_mixed_record_and_single_format_hashes(sensitivity_store):
    from quantmla.run import run

    record = run(run_config(*tiny_job(sensitivity_store, *MIXED, "precision.joint_top=3")))
    m = record["metrics"]
    assert record["config"]["precision"]["budget_bytes"] == 96
    assert len(m["allocation/precisions"]) == 6
    assert m["ppl/wikitext2"] > 1
    # the joint check: the error model's 3 best, run whole; the lowest KL to BF16 is the allocation
    shortlist, kl = m["allocation/joint_allocations"], m["allocation/joint_kl"]
    assert len(shortlist) == len(set(map(tuple, shortlist))) == 3
    assert m["allocation/joint_predicted"] == sorted(m["allocation/joint_predicted"])
    assert m["allocation/precisions"] == shortlist[int(np.argmin(kl))] and min(kl) > 0
    # beside it, the uniform candidate that spends the budget best (C2R4: C4R4 is over 96 B)
    assert (
        list(m["allocation/joint_uniform"]) == ["c2r4"]
        and m["allocation/joint_uniform"]["c2r4"] > 0
    )
    single = run(run_config(*tiny_job(sensitivity_store, "precision=c4r4")))
    # a single-format record's precision block is what it was before mixed existed (same hash)
    assert set(single["config"]["precision"]) == {"name", "sink", "recent", "group_size"}
    assert single["metrics"]["cache/bytes_per_token"] == 112


@needs_tiny
def test_allocation_under_rtn_calibrates_the_method_once_at_the_allocation(
    sensitivity_store, tmp_path
):
    from quantmla.job import resolve
    from quantmla.prepare import prepare

    artifacts = tmp_path / "artifacts"
    under_rtn = [*MIXED, *SMALL_QUANTMLA, "precision.allocation_method=rtn"]
    job = resolve(
        run_config(*tiny_job(sensitivity_store, *under_rtn, f"paths.artifacts_dir={artifacts}"))
    )
    m = prepare(job).metrics
    rtn = prepare(resolve(run_config(*tiny_job(sensitivity_store, *MIXED)))).metrics
    # the candidates' errors are RTN's, so the allocation is the RTN mixed job's
    assert m["allocation/measured_under"] == "rtn"
    assert m["allocation/predicted_errors"] == rtn["allocation/predicted_errors"]
    assert m["allocation/precisions"] == rtn["allocation/precisions"]
    # and QuantMLA calibrated once, at that allocation, not at each candidate
    saved = list((artifacts / "quantmla").glob("*.safetensors"))
    assert len(saved) == 1
    assert m["method/report"]["seconds_fit"] > 0
    # the field is in the record only away from its default (mixed records made before keep their hash)
    assert job.config["precision"]["allocation_method"] == "rtn"
    assert (
        "allocation_method"
        not in resolve(run_config(*tiny_job(sensitivity_store, *MIXED))).config["precision"]
    )


@needs_tiny
def test_errors_without_transforms_are_measured_once_for_every_budget(
    sensitivity_store, tmp_path, monkeypatch
):
    from quantmla import mixed
    from quantmla.job import resolve
    from quantmla.prepare import prepare

    calls, measure = [], mixed.format_errors
    monkeypatch.setattr(mixed, "format_errors", lambda *a, **k: calls.append(1) or measure(*a, **k))

    def allocation(*overrides):
        job = resolve(run_config(*tiny_job(sensitivity_store, *MIXED, *overrides)))
        return prepare(job).metrics

    where = f"paths.artifacts_dir={tmp_path}"
    first = allocation(where)
    second = allocation(where, "precision.budget_bytes=104", "precision.joint_top=2")
    assert len(calls) == 1 and "allocation/errors_loaded_from" not in first
    [saved] = (tmp_path / "allocation").glob("*.json")
    assert second["allocation/errors_loaded_from"] == saved.name
    for key in mixed.ERROR_KEYS:
        assert second[f"allocation/{key}"] == first[f"allocation/{key}"]
    allocation(where, "precision.candidates=[c2r4,c3r4,c4r4]")  # other quantizers: measured
    assert len(calls) == 2 and len(list((tmp_path / "allocation").glob("*.json"))) == 2
    # a subset of measured candidates, in another order: their columns, nothing measured
    subset = allocation(where, "precision.candidates=[c4r4,c3r4]", "precision.budget_bytes=128")
    assert len(calls) == 2 and len(list((tmp_path / "allocation").glob("*.json"))) == 2
    wider = allocation(where, "precision.candidates=[c2r4,c3r4,c4r4]")
    for key in mixed.ERROR_KEYS:
        assert subset[f"allocation/{key}"] == [row[::-1][:2] for row in wider[f"allocation/{key}"]]


@needs_tiny
def test_errors_saved_under_a_retired_config_hash_are_loaded_after_migration(
    sensitivity_store, tmp_path, monkeypatch
):
    """Errors saved by the older key (the config hashed with the checkout's path) are measured
    again by today's code until `quantmla.migrate` retires that hash; then they are loaded."""
    import quantmla.methods.prepare as prepare_module
    from quantmla import mixed
    from quantmla.job import resolve
    from quantmla.migrate import retire_config_hashes
    from quantmla.prepare import prepare
    from quantmla.tracking.store import stable_hash

    calls, measure = [], mixed.format_errors
    monkeypatch.setattr(mixed, "format_errors", lambda *a, **k: calls.append(1) or measure(*a, **k))

    def allocation():
        where = f"paths.artifacts_dir={tmp_path / 'artifacts'}"
        return prepare(resolve(run_config(*tiny_job(sensitivity_store, *MIXED, where)))).metrics

    with monkeypatch.context() as older:
        older.setattr(prepare_module, "config_sha", lambda c: stable_hash(c.to_dict(), 16))
        first = allocation()
    [older_file] = (tmp_path / "artifacts" / "allocation").glob("*.json")
    allocation()  # today's key misses it: measured again
    assert len(calls) == 2
    [today] = set(older_file.parent.glob("*.json")) - {older_file}
    today.unlink()
    assert retire_config_hashes(tmp_path)["retired"] == 1
    again = allocation()
    assert len(calls) == 2 and again["allocation/errors_loaded_from"] == older_file.name
    for key in mixed.ERROR_KEYS:
        assert again[f"allocation/{key}"] == first[f"allocation/{key}"]


@needs_tiny
def test_teacher_forced_answers_read_each_layers_own_format(sensitivity_store):
    """eval=ruler_answer under a mixed allocation: the record's answer log-likelihoods are the
    allocated model's full forward (float64), not the uniform C2R4 model's."""
    from quantmla.evaluation.lm_eval.niah import generate
    from quantmla.evaluation.ruler_answer import answer_ids
    from quantmla.job import resolve
    from quantmla.prepare import prepare
    from quantmla.run import run

    answer = ["eval=ruler_answer", "eval.tasks=[s_niah_1]", "eval.context_lengths=[512]", "eval.limit=2"]  # fmt: skip
    mixed = run_config(*tiny_job(sensitivity_store, *MIXED, *answer))
    record = run(mixed)

    def logliks(cfg):
        prepared = prepare(resolve(cfg))
        samples = generate(
            "niah_single_1", 512, prepared.tokenizer, prepared.paths.data_dir, 2, cfg.seed
        )
        out = []
        for prompt, value in (answer_ids(prepared.tokenizer, s) for s in samples):
            with torch.no_grad():
                logits = prepared.model(torch.tensor([prompt + value])).logits[0].double()
            logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
            out.append(float(logp[torch.arange(len(value)), value].sum()))
        return out

    got = record["metrics"]["docs/ruler_answer/s_niah_1/512/loglik"]
    assert sorted(record["metrics"]["allocation/precisions"]) == ["c2r4"] * 3 + ["c4r4"] * 3
    assert got == pytest.approx(logliks(mixed), rel=1e-5)
    uniform = logliks(run_config(*tiny_job(sensitivity_store, "precision=c2r4", *answer)))
    assert all(abs(a - b) > 1e-4 for a, b in zip(got, uniform))


@needs_tiny
@pytest.mark.parametrize(
    ("overrides", "error", "named"),
    [
        (["precision.budget_bytes=null"], ConfigError, "precision.budget_bytes"),
        (["precision.budget_bytes=60"], ConfigError, ">= 80"),
        (["precision.candidates=[c4r4,c9r4]"], ConfigError, "c9r4"),
        (["precision.sensitivity_experiment=none"], DataNotFoundError, "sensitivity records"),
        (["eval=sensitivity"], ConfigError, "perplexity"),
        (["precision.allocation_error=kl"], ConfigError, "precision.allocation_error"),
        (["precision.joint_top=0"], ConfigError, "precision.joint_top"),
        (["precision.allocation_method=quantmla"], ConfigError, "precision.allocation_method"),
        (["method=quantmla", "method.artifact=x.safetensors"], ConfigError, "method.artifact"),
    ],
)
def test_mixed_refusals_name_the_field(sensitivity_store, overrides, error, named):
    from quantmla.job import resolve

    with pytest.raises(error, match=named):
        resolve(run_config(*tiny_job(sensitivity_store, *MIXED, *overrides)))


@pytest.mark.parametrize("method", ["rtn", "random", "quarot"])
def test_format_errors_equal_the_fused_patched_layers(method):
    """Each path's output NMSE measured unfused equals that of the fused model's layer with only that
    path quantized (simulator, protection sink 3 + recent 8), fed the same BF16 inputs: float64, V2
    pair layout."""
    import copy

    from transformers import AutoModelForCausalLM

    from quantmla.calibration.context import CalibrationContext
    from quantmla.methods.base import MethodJob, MethodResult, apply_method
    from quantmla.methods.quarot import quarot
    from quantmla.mixed import format_errors
    from quantmla.models.adapters import get_adapter
    from quantmla.models.capture import OutputNMSE, capture_inputs
    from quantmla.models.tiny import tiny_mla_v2_config
    from quantmla.simulator import patch_model, set_policy
    from quantmla.spec import QuantizerSpec
    from quantmla.transforms import LayerTransforms
    from tests.test_transforms import random_transforms

    torch.manual_seed(0)
    config = tiny_mla_v2_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    fused = copy.deepcopy(
        model
    )  # before patching: a patched module's forward is bound to its patch
    patch_model(fused, "bf16", sink=3, recent=8)
    names = ["c2r16", "c16r2", "c3r4", "ce4m3r16", "c3r2"]  # c3r2 shares both paths
    specs = {name: QuantizerSpec.from_precision(name) for name in names}
    if method == "random":
        result = MethodResult(
            "random", [LayerTransforms(*random_transforms(256, 64, seed=i)) for i in range(2)]
        )
    else:
        result = None if method == "rtn" else quarot(MethodJob(modules, specs["c3r4"]))
    sequences = torch.randint(0, 64, (1, 48))
    store = capture_inputs(model, modules, sequences)
    ctx = CalibrationContext(model, adapter, modules, store, torch.arange(1), torch.arange(0))
    got = format_errors(ctx, dict.fromkeys(names, result), specs, sink=3, recent=8)

    reference = OutputNMSE.capture(model, modules, sequences)
    if result is not None:
        apply_method(fused, adapter, result)
    fused_modules = adapter.attention_modules(fused)
    for j, name in enumerate(names):
        content_only = name.split("r")[0] + "r16" if specs[name].content_bits < 16 else None
        rope_only = "c16r" + name.split("r")[1] if specs[name].rope_bits < 16 else None
        for key, alone in (("output_content", content_only), ("output_rope", rope_only)):
            if alone is None:
                assert (got[key][:, j] == 0).all()
                continue
            set_policy(fused, precision=alone)
            expected = reference.measure(fused_modules)
            # float64 both ways; an FP8 code one rounding boundary apart moves a 1e-5 NMSE by ~1e-3
            rtol = 2e-3 if specs[name].fp8 else 1e-4  # (RoPE tables are float32)
            np.testing.assert_allclose(got[key][:, j], expected, rtol=rtol)
    assert (got["cache_content"][:, names.index("c16r2")] == 0).all()
    assert (got["cache_rope"][:, names.index("c2r16")] > 0).sum() == 0
    assert (got["cache_content"] >= 0).all() and got["cache_content"][
        0, names.index("c2r16")
    ] > 1e-3


def test_loss_weights_are_kl_per_unit_of_the_layers_own_output_error():
    """With layer ℓ alone quantized, its inputs are exact: the output NMSE seen inside the full run
    equals the isolated per-layer measurement (OutputNMSE), and the KL is the float64 KL of the two
    next-token distributions."""
    from transformers import AutoModelForCausalLM

    from quantmla.mixed import loss_weights
    from quantmla.models.adapters import get_adapter
    from quantmla.models.capture import OutputNMSE
    from quantmla.models.tiny import tiny_mla_v2_config
    from quantmla.simulator import patch_model, set_policy

    torch.manual_seed(0)
    config = tiny_mla_v2_config(vocab_size=64, hidden_size=64, num_layers=3, num_heads=2)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    modules = get_adapter(model.config).attention_modules(model)
    patch_model(model, "bf16", sink=2, recent=4)
    windows = torch.randint(0, 64, (2, 24))
    kl, out_nmse, weights = loss_weights(model, modules, windows, probe="c2r2", batch_size=2)

    reference = OutputNMSE.capture(model, modules, windows)
    set_policy(model, precision="c2r2")
    np.testing.assert_allclose(out_nmse, reference.measure(modules), rtol=1e-6)  # float32 there
    for layer in range(3):
        set_policy(model, precision="bf16")
        p = torch.log_softmax(model(windows).logits, -1)
        set_policy(model, precision=["bf16"] * layer + ["c2r2"] + ["bf16"] * (2 - layer))
        q = torch.log_softmax(model(windows).logits, -1)
        expected = torch.distributions.kl_divergence(
            torch.distributions.Categorical(logits=p), torch.distributions.Categorical(logits=q)
        ).mean()
        assert kl[layer] == pytest.approx(float(expected), rel=1e-9)
    np.testing.assert_allclose(weights, kl / out_nmse)
    assert (kl > 0).all()


def test_joint_kl_is_the_fused_mixed_models_kl():
    """The joint check's KL of an allocation = float64 KL(BF16 ‖ a fresh copy with each layer's
    transforms at its format fused by apply_method and patched at that format); the model is left
    unfused and BF16; an all-BF16 allocation costs exactly 0."""
    import copy

    from transformers import AutoModelForCausalLM

    from quantmla.methods.base import MethodResult, apply_method
    from quantmla.mixed import joint_kl
    from quantmla.models.adapters import get_adapter
    from quantmla.models.tiny import tiny_mla_v2_config
    from quantmla.simulator import layer_patch, patch_model, set_policy
    from quantmla.transforms import LayerTransforms
    from tests.test_transforms import random_transforms

    torch.manual_seed(0)
    config = tiny_mla_v2_config(vocab_size=64, hidden_size=64, num_layers=3, num_heads=2)
    base = AutoModelForCausalLM.from_config(config).double().eval()
    model = copy.deepcopy(base)
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    patch_model(model, "bf16", sink=2, recent=4)
    before = copy.deepcopy(model.state_dict())
    results = {
        name: MethodResult(
            "random",
            [LayerTransforms(*random_transforms(256, 64, seed=10 * s + i)) for i in range(3)],
        )
        for s, name in enumerate(["c2r4", "c3r2"])
    }
    results["bf16"] = None
    allocations = [("c2r4", "c3r2", "bf16"), ("c3r2", "c3r2", "c2r4"), ("bf16",) * 3]
    windows = torch.randint(0, 64, (3, 20))
    got = joint_kl(model, adapter, modules, results, allocations, windows, batch_size=2)

    reference = torch.log_softmax(base(windows).logits, -1)
    for kl, precisions in zip(got[:2], allocations):
        fused = copy.deepcopy(base)
        patch_model(fused, list(precisions), sink=2, recent=4)
        layers = [
            results[p].layers[i] if results[p] else LayerTransforms(None, None)
            for i, p in enumerate(precisions)
        ]
        apply_method(fused, adapter, MethodResult("mixed", layers))
        logits = fused(windows).logits
        per_batch = [
            torch.distributions.kl_divergence(
                torch.distributions.Categorical(logits=reference[s]),
                torch.distributions.Categorical(logits=logits[s]),
            ).mean()
            for s in (slice(0, 2), slice(2, 3))
        ]
        assert kl == pytest.approx(float(sum(per_batch) / 2), rel=1e-9)
        assert kl > 1e-6
    assert got[2] == 0.0
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(layer_patch(m).rope_online is None for m in modules)
    assert [layer_patch(m).policy.precision for m in modules] == ["bf16"] * 3
    # a patched model's deep copy is patched on its own: its policy reaches its forward only
    twin = copy.deepcopy(model)
    set_policy(twin, precision="c2r2")
    assert not torch.equal(twin(windows).logits, model(windows).logits)
