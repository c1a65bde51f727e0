"""Methods on a tiny random MLA model: SmoothQuant† α = 0, QuantMLA steps, artifacts, QuaRot†, equivalence."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantmla import patch_model, set_policy
from quantmla.calibration.module import QuantMLACalibration
from quantmla.config import CalibrationConfig
from quantmla.methods.base import (
    ArtifactMismatchError,
    MethodJob,
    MethodResult,
    apply_method,
    load_artifact,
    save_artifact,
)
from quantmla.methods.equivalence import EquivalenceProbe, FusionEquivalenceError
from quantmla.methods.quarot import quarot
from quantmla.methods.smoothquant import (
    alpha_search,
    heldout_output_nmse,
    scales_from_statistics,
)
from quantmla.models.adapters import get_adapter
from quantmla.simulator import layer_patch
from quantmla.spec import QuantizerSpec
from quantmla.transforms import ContentTransform, LayerTransforms, RopeTransform
from tests.conftest import fit_stopped_at

C4R4 = QuantizerSpec.from_precision("c4r4")


def test_alpha_zero_is_the_identity(ctx):
    stat_c, stat_p = ctx.channel_statistics(0)
    assert torch.equal(
        scales_from_statistics(stat_c, 0.0), torch.ones_like(stat_c, dtype=torch.float64)
    )
    identity = ContentTransform(
        torch.eye(ctx.modules[0].kv_lora_rank, dtype=torch.float64),
        scales_from_statistics(stat_c, 0.0),
    )
    with_identity = heldout_output_nmse(ctx, 0, C4R4, content=identity)
    native = heldout_output_nmse(
        ctx, 0, C4R4, content=ContentTransform.identity(ctx.modules[0].kv_lora_rank)
    )
    assert with_identity == pytest.approx(native, rel=1e-6)
    scales = scales_from_statistics(stat_c, 0.5)
    assert torch.log(scales).mean().abs() < 1e-9  # unit geometric mean
    assert torch.all(
        (scales[1:] - scales[:-1]) * (stat_c[1:] - stat_c[:-1]).double() <= 1e-12
    )  # larger channel, smaller scale


def test_kept_teacher_outputs_are_the_recomputed_ones(ctx):
    kept = dataclasses.replace(ctx, keep_teacher=True)
    _, first = kept.project(0, torch.tensor([1, 5]))  # computed in blocks of 4: 0-3 and 4-5
    assert kept._teacher[0][1].all()
    _, served = kept.project(0, torch.tensor([3, 1]))  # from memory
    assert torch.equal(served[1], first[0])
    _, recomputed = ctx.project(0, torch.tensor([3, 1]))
    torch.testing.assert_close(served, recomputed, rtol=1e-6, atol=1e-7)
    assert ctx.project(0, torch.tensor([0]), teacher=False)[1] is None
    # the α search picks the same scales either way (its held-out batches projected once a layer)
    assert (
        alpha_search(kept, C4R4, [0.0, 0.5, 1.0])[1] == alpha_search(ctx, C4R4, [0.0, 0.5, 1.0])[1]
    )


def test_quantmla_steps_lower_both_objectives(ctx):
    module = QuantMLACalibration(
        ctx,
        [LayerTransforms() for _ in ctx.modules],
        C4R4,
        CalibrationConfig(lr_rotation=5e-3, lr_scale=5e-2),
    )
    module.log = lambda *a, **k: None
    optimizer = module.configure_optimizers()
    batch = torch.arange(4)
    before = [module.losses(i, batch, ste=False) for i in range(len(ctx.modules))]
    for _ in range(15):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    after = [module.losses(i, batch, ste=False) for i in range(len(ctx.modules))]
    for (c0, r0), (c1, r1) in zip(before, after):
        assert c1 < c0 and r1 < r0


def test_each_layer_calibrates_at_its_own_spec(ctx):
    """One spec per layer (a mixed allocation): every objective and the α search read that layer's
    own spec — a BF16 layer's losses are exactly 0, an INT2 latent's content loss exceeds the INT4 one's."""
    from quantmla.methods.smoothquant import alpha_search

    c2r4, bf16 = QuantizerSpec.from_precision("c2r4"), QuantizerSpec.from_precision("bf16")
    config = CalibrationConfig()
    mixed = QuantMLACalibration(ctx, [LayerTransforms() for _ in ctx.modules], [bf16, c2r4], config)
    uniform = QuantMLACalibration(ctx, [LayerTransforms() for _ in ctx.modules], C4R4, config)
    batch = torch.arange(4)
    assert [float(v) for v in mixed.losses(0, batch, ste=False)] == [0.0, 0.0]
    (content_c2, rope_c2), (content_c4, rope_c4) = (
        m.losses(1, batch, ste=False) for m in (mixed, uniform)
    )
    assert content_c2 > 2 * content_c4 > 0 and rope_c2 == rope_c4 > 0  # both RoPE keys at INT4
    _, report = alpha_search(ctx, [bf16, c2r4], [0.0, 0.5])
    assert report["heldout_nmse"][0] == {"content": 0.0, "rope": 0.0}
    assert min(report["heldout_nmse"][1].values()) > 0


def test_artifact_round_trip_and_mismatch(tmp_path):
    g = torch.Generator().manual_seed(0)
    layers = [
        LayerTransforms(
            ContentTransform(
                torch.randn(8, 8, generator=g, dtype=torch.float64),
                torch.rand(8, dtype=torch.float64),
            ),
            RopeTransform(torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64)),
        ),
        LayerTransforms(
            None,
            RopeTransform(torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64)),
        ),
    ]
    meta = {
        "model": "m",
        "precision": "c4r4",
        "quantizer": "q",
        "method": "quantmla",
        "seed": "0",
        "calibration_data": "abc",
    }
    path = tmp_path / "a.safetensors"
    save_artifact(MethodResult("quantmla", layers, None, meta, {"loss": [1.0]}), path)
    back = load_artifact(path, meta)
    assert (
        back.method == "quantmla"
        and back.report == {"loss": [1.0]}
        and back.layers[1].content is None
    )
    assert back.metadata == meta  # as saved: its key is the fitted result's
    assert torch.equal(back.layers[0].content.rotation, layers[0].content.rotation)
    assert torch.equal(back.layers[1].rope.scales, layers[1].rope.scales)
    with pytest.raises(ArtifactMismatchError, match="precision='c4r4' but this run needs 'c2r4'"):
        load_artifact(path, {**meta, "precision": "c2r4"})
    # a config hash older code wrote loads where it is retired, read as its current one
    older = tmp_path / "older.safetensors"
    save_artifact(
        MethodResult("quantmla", layers, None, {**meta, "model_config_hash": "old"}), older
    )
    today = {**meta, "model_config_hash": "new"}
    with pytest.raises(ArtifactMismatchError, match="model_config_hash='old'"):
        load_artifact(older, today)
    assert load_artifact(older, today, {"old": "new"}).metadata == today
    # an identity rotation (SmoothQuant†'s) is left out of the file and comes back as the identity
    scale = torch.rand(8, dtype=torch.float64) + 0.5
    smooth = [LayerTransforms(ContentTransform(torch.eye(8, dtype=torch.float64), scale), None)]
    save_artifact(MethodResult("quantmla", smooth, None, meta, {}), tmp_path / "s.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        assert set(f.keys()) == {"layers.0.content.scale"}
    back = load_artifact(tmp_path / "s.safetensors", meta).layers[0].content
    assert torch.equal(back.rotation, torch.eye(8, dtype=torch.float64))
    assert torch.equal(back.scale, scale)


def test_quarot_and_equivalence_check(ctx):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ctx.model.config).eval()
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    patch_model(model, "bf16")
    x = torch.randint(0, 128, (2, 40))
    probe = EquivalenceProbe(x).capture(model, modules)
    apply_method(model, adapter, quarot(MethodJob(modules, C4R4)))
    report = probe.check(model, modules)
    assert report["max_layer_rel_error"] < 1e-5
    online = layer_patch(modules[0]).rope_online
    assert torch.allclose(online @ online.T, torch.eye(64), atol=1e-6)
    # a wrong fusion is caught: break the RoPE rows of one layer
    with torch.no_grad():
        modules[1].kv_a_proj_with_mqa.weight[-64:] *= 1.5
    set_policy(model, precision="bf16")
    with pytest.raises(FusionEquivalenceError, match="layer 1"):
        probe.check(model, modules)


def test_artifacts_are_keyed_by_the_fit_settings(tmp_path):
    """Two runs that differ only in a fit setting (steps, learning rates, α grid, …) never share
    an artifact; capture batching, which does not change the fit, does."""
    import json
    from types import SimpleNamespace

    from quantmla.methods.prepare import artifact_metadata
    from quantmla.models.tiny import tiny_mla_v2_config
    from quantmla.spec import QuantizerSpec
    from quantmla.tracking.store import stable_hash
    from tests.conftest import run_config, tiny_job

    model = SimpleNamespace(config=tiny_mla_v2_config(vocab_size=64, num_layers=2))
    specs = [QuantizerSpec.from_precision("c2r4")] * 2

    def key(*overrides):
        cfg = run_config(*tiny_job(tmp_path, "method=quantmla", *overrides))
        return stable_hash(artifact_metadata(cfg, model, specs, "data", "w"), 16)

    base = key()
    changed = [
        key(o)
        for o in (
            "method.calibration.steps=7",
            "method.calibration.lr_rotation=0.5",
            "method.calibration.alphas=[0.5]",
            "method.calibration.select_every=3",
            "method.calibration.rope_objective=output",
        )
    ]
    assert len({base, *changed}) == 6
    # a setting added later enters the key only off its default: earlier artifacts keep theirs
    cfg = run_config(*tiny_job(tmp_path, "method=quantmla"))
    fit = json.loads(artifact_metadata(cfg, model, specs, "data", "w")["calibration"])
    assert sorted(fit) == [
        "alphas",
        "batch_size",
        "lr_rotation",
        "lr_scale",
        "select_every",
        "steps",
    ]
    assert key("method.calibration.capture_batch_size=1") == base


def test_calibration_batches_are_the_shuffled_loaders():
    """`step_batches` is what the shuffled DataLoader gave epoch after epoch (existing artifacts
    and records keep their batches), cut at the step count."""
    from quantmla.methods.quantmla_method import step_batches

    indices = torch.arange(10, 17)
    loader = torch.utils.data.DataLoader(
        indices, batch_size=2, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    seen = [b for _ in range(4) for b in loader]
    got = step_batches(indices, 2, 11, seed=3)
    assert len(got) == 11 and all(torch.equal(a, b) for a, b in zip(got, seen))


@pytest.mark.parametrize("keep_teacher", [False, True])
def test_a_stopped_calibration_resumes_where_it_stopped(ctx, tmp_path, monkeypatch, keep_teacher):
    """A fit stopped after a saved selection resumes from it, without the α search again: the
    same selections, history, final transforms and search report as an uninterrupted fit; the
    saved state is gone once it finishes. Kept teacher outputs start empty in each process."""
    from quantmla.methods.quantmla_method import quantmla

    cal = CalibrationConfig(steps=6, select_every=2, batch_size=2, alphas=[0.0])

    def job(resume=None):
        fresh = dataclasses.replace(ctx, keep_teacher=keep_teacher)  # a new process's memory
        return MethodJob(ctx.modules, C4R4, cal, fresh, seed=0, resume_path=resume)

    whole = quantmla(job())
    assert 0 < whole.report["seconds_selection"] < whole.report["seconds_fit"]  # where time goes
    resume = tmp_path / "fit.ckpt"
    with fit_stopped_at(monkeypatch, 3):
        quantmla(job(resume))
    assert resume.is_file()

    def searched_again(*args, **kwargs):
        raise AssertionError("a resumed fit searched for its start again")

    monkeypatch.setattr("quantmla.methods.quantmla_method.alpha_search", searched_again)
    resumed = quantmla(job(resume))
    assert resumed.report["resumed_at_step"] == 2 and not resume.exists()
    assert resumed.report["init"] == whole.report["init"]  # the search's report, from the state
    assert resumed.report["history"] == whole.report["history"]
    assert resumed.report["best_step"] == whole.report["best_step"]
    for a, b in zip(resumed.layers, whole.layers):
        assert torch.equal(a.content.rotation, b.content.rotation)
        assert torch.equal(a.rope.angles, b.rope.angles) and torch.equal(
            a.rope.scales, b.rope.scales
        )


def latent_at_1000(ctx, dtype):
    """A fresh seeded model of ctx's config in `dtype`, its latent norms' Γ times 1000 (as
    SmolLM2-MLA's conversion leaves them): (model, adapter, MLA modules)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ctx.model.config).eval().to(dtype)
    adapter = get_adapter(model.config)
    modules = adapter.attention_modules(model)
    with torch.no_grad():
        for m in modules:
            m.kv_a_layernorm.weight.mul_(1000)
    return model, adapter, modules


def test_every_method_keeps_the_cache_at_the_latents_magnitude(ctx, monkeypatch):
    """With the latent norm's Γ ≈ 1000 (SmolLM2-MLA's conversion) each method's content scales
    have geometric mean latent_magnitude(Γ) = 1024, so z_C sits where c does; QuaRot† still fuses
    exactly; QuantMLA's scales start there and are clipped relative to it."""
    model, adapter, modules = latent_at_1000(ctx, torch.float32)
    patch_model(model, "bf16")
    probe = EquivalenceProbe(torch.randint(0, 128, (2, 40))).capture(model, modules)
    result = quarot(MethodJob(modules, C4R4))
    assert all(torch.all(t.content.scale == 1024.0) for t in result.layers)
    apply_method(model, adapter, result)  # float32 rounding: 1.3e-5 at unit scales too
    assert probe.check(model, modules)["max_layer_rel_error"] < 3e-5

    gamma = ctx.gamma
    monkeypatch.setattr(ctx, "gamma", lambda layer: 1000 * gamma(layer))
    init, _ = alpha_search(ctx, C4R4, [0.5, 1.0])
    for t in init:
        assert float(t.content.scale.log2().mean()) == pytest.approx(10.0, abs=1e-9)
    params = QuantMLACalibration(ctx, init, C4R4, CalibrationConfig(steps=1)).layers[0]
    assert params.magnitude == 1024.0
    assert torch.allclose(params.content()[1].double(), init[0].content.scale, rtol=1e-5)
    with torch.no_grad():
        params.log_content_scale.fill_(5.0)
    assert torch.allclose(params.content()[1], torch.tensor(1024 * torch.e**2))


@pytest.mark.parametrize("precision", ["c2r4", "cmxfp4r16", "cnvfp4r16"])
def test_the_magnitude_changes_a_fused_bf16_model_only_in_fixed_range_formats(ctx, precision):
    """QuaRot† fused into a BF16 model with Γ ≈ 1000, its content scales at latent_magnitude(Γ)
    or at 1: the quantized model's logits are bit for bit alike where the format's scales follow
    the values (a power of two moves no mantissa through fusion or the cache) and not on NVFP4."""
    spec, x = QuantizerSpec.from_precision(precision), torch.randint(0, 128, (2, 200))
    logits = []
    for unit in (False, True):
        model, adapter, modules = latent_at_1000(ctx, torch.bfloat16)
        patch_model(model, precision, sink=1, recent=2)
        result = quarot(MethodJob(modules, spec))
        for t in result.layers if unit else ():
            t.content.scale = torch.ones_like(t.content.scale)
        apply_method(model, adapter, result)
        with torch.no_grad():
            logits.append(model(x).logits)
    assert torch.equal(*logits) == (not spec.fixed_range("content"))
