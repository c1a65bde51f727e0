"""Units taken from earlier fits (quantmla/methods/reuse.py): a layer's content and RoPE transforms
are separable, so a fit of one path alone gives, bit for bit, that path's transforms of a fit of
both; a run takes the units an earlier artifact holds and fits only the rest, or nothing."""

import dataclasses

import pytest
import torch

from quantmla.config import CalibrationConfig
from quantmla.errors import ConfigError
from quantmla.methods.base import MethodJob, save_artifact
from quantmla.methods.quantmla_method import quantmla
from quantmla.methods.reuse import MAGNITUDE, Unit, assemble, needed_units, saved_units
from quantmla.methods.smoothquant import smoothquant
from quantmla.spec import QuantizerSpec
from tests.conftest import fit_stopped_at, needs_tiny, run_config, tiny_job

C2R4, C2R16, C16R4, C4R4 = (QuantizerSpec.from_precision(p) for p in ("c2r4", "c2r16", "c16r4", "c4r4"))  # fmt: skip
CAL = CalibrationConfig(steps=4, select_every=2, batch_size=2, alphas=[0.0, 0.5, 1.0])


def fit(ctx, spec, method=quantmla, fixed=None):
    return method(MethodJob(ctx.modules, spec, CAL, ctx, seed=0, fixed=fixed or {}))


def tensors(transform) -> list[torch.Tensor]:
    return [getattr(transform, f.name) for f in dataclasses.fields(transform)]


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b), strict=True))


@pytest.fixture(scope="module")
def c2r4_fit(ctx):
    return fit(ctx, C2R4)


def test_spec_keys_read_back_and_path_keys():
    for precision in (
        "bf16",
        "c4r4",
        "c2r16",
        "ce4m3r16",
        "cnvfp4re4m3t",
        "cmxfp4rmxfp4",
        "clm4r16",
    ):
        spec = QuantizerSpec.from_precision(precision)
        assert QuantizerSpec.from_key(spec.key) == spec
    odd = QuantizerSpec.from_precision("c3r8", group_size=32, content_meta_dtype="float16")
    assert QuantizerSpec.from_key(odd.key) == odd
    with pytest.raises(ConfigError, match="quantizer"):
        QuantizerSpec.from_key("c4r4-something")
    assert C2R4.path_key("content") == C2R16.path_key("content") != C4R4.path_key("content")
    assert C2R4.path_key("rope") == C4R4.path_key("rope") == C16R4.path_key("rope")
    assert C2R16.path_key("rope") is None and C16R4.path_key("content") is None
    assert needed_units([C2R16, C16R4]) == {
        (0, "content"): C2R4.path_key("content"),
        (1, "rope"): C2R4.path_key("rope"),
    }
    # an engine format's own blocks and scales: the spec's group size does not change its codes
    lm4 = QuantizerSpec.from_precision("clm4r16")
    assert lm4.path_key("content") == dataclasses.replace(lm4, group_size=32).path_key("content")
    assert C2R4.path_key("content") != dataclasses.replace(C2R4, group_size=32).path_key("content")


@pytest.mark.parametrize("method", [quantmla, smoothquant])
def test_one_path_alone_fits_that_paths_transforms_of_both_bit_for_bit(ctx, c2r4_fit, method):
    both = c2r4_fit if method is quantmla else fit(ctx, C2R4, smoothquant)
    content_alone, rope_alone = fit(ctx, C2R16, method), fit(ctx, C16R4, method)
    for layer in range(len(ctx.modules)):
        assert_same(content_alone.layers[layer].content, both.layers[layer].content)
        assert_same(rope_alone.layers[layer].rope, both.layers[layer].rope)


def test_held_units_are_not_fitted_again(ctx, c2r4_fit, monkeypatch):
    """The content units handed in: the content objective is never computed, the RoPE units are
    fitted, and the result is the whole fit's, with where each unit came from."""

    def computed(*args, **kwargs):
        raise AssertionError("a held unit's objective was computed")

    for where in ("quantmla.calibration.module", "quantmla.methods.smoothquant"):
        monkeypatch.setattr(f"{where}.content_qdq", computed)
    held = {(i, "content"): Unit(t.content, "a.safetensors") for i, t in enumerate(c2r4_fit.layers)}
    partial = fit(ctx, C2R4, fixed=held)
    for got, want in zip(partial.layers, c2r4_fit.layers):
        assert_same(got.content, want.content)
        assert_same(got.rope, want.rope)
    assert partial.report["reused"] == {"a.safetensors": ["0/content", "1/content"]}
    assert all(
        set(entry) == {"step", "layer0/rope", "layer1/rope"} for entry in partial.report["history"]
    )


def test_saved_units_match_on_the_path_and_the_shared_settings(tmp_path, c2r4_fit):
    def metadata(spec, seed="0"):
        return {"model": "m", "method": "quantmla", "seed": seed, "calibration": "{}",
                "precision": spec.precision, "quantizer": spec.key}  # fmt: skip

    save_artifact(
        dataclasses.replace(c2r4_fit, metadata=metadata(C2R4)), tmp_path / "a.safetensors"
    )
    other_seed = dataclasses.replace(c2r4_fit, metadata=metadata(C4R4, seed="1"))
    save_artifact(other_seed, tmp_path / "b.safetensors")
    units = saved_units(tmp_path, metadata(C2R16), [C2R16, C2R16])
    assert set(units) == {(0, "content"), (1, "content")}
    assert_same(units[(1, "content")].transform, c2r4_fit.layers[1].content)
    assert units[(1, "content")].step == c2r4_fit.report["best_step"][1]["content"]
    # C4R4 at seed 0: only the RoPE units are held (the seed-1 artifact shares no settings)
    assert set(saved_units(tmp_path, metadata(C4R4), [C4R4, C4R4])) == {(0, "rope"), (1, "rope")}
    # a per-layer allocation: each layer's own path
    units = saved_units(tmp_path, metadata(C2R16), [C2R16, C16R4])
    assert set(units) == {(0, "content"), (1, "rope")}
    result = assemble("quantmla", 2, units)
    assert result.layers[0].rope is None and result.layers[1].content is None
    assert_same(result.layers[1].rope, c2r4_fit.layers[1].rope)
    assert result.report["reused"] == {"a.safetensors": ["0/content", "1/rope"]}


def test_fixed_range_content_units_need_the_latents_magnitude(tmp_path, c2r4_fit):
    """An NVFP4 content unit fitted before the content scales started at the latent's magnitude
    (no `content_magnitude` in its artifact) is not taken; its FP8 RoPE units are, as are both
    from an artifact that says so."""
    nvfp4, latent, key = (QuantizerSpec.from_precision(p) for p in ("cnvfp4re4m3t", "cnvfp4r16", "c16re4m3t"))  # fmt: skip
    shared = {"model": "m", "method": "quantmla", "seed": "0", "calibration": "{}"}
    mine = {**shared, "precision": nvfp4.precision, "quantizer": nvfp4.key}
    save_artifact(dataclasses.replace(c2r4_fit, metadata=mine), tmp_path / "a.safetensors")
    wanted = {**shared, **MAGNITUDE}
    assert saved_units(tmp_path, wanted, [latent, latent]) == {}
    assert set(saved_units(tmp_path, wanted, [key, key])) == {(0, "rope"), (1, "rope")}
    save_artifact(
        dataclasses.replace(c2r4_fit, metadata={**mine, **MAGNITUDE}), tmp_path / "b.safetensors"
    )
    units = saved_units(tmp_path, wanted, [latent, latent])
    assert {u.source for u in units.values()} == {"b.safetensors"} and len(units) == 2


@needs_tiny
def test_a_run_whose_units_were_all_fitted_fits_nothing(tmp_path, monkeypatch):
    """End to end: C2R4 is fitted and saved; C2R16 then assembles its transforms from that
    artifact without capturing a teacher, and scores as its own fit does."""
    from quantmla.run import run

    small = ["method=quantmla", "method.calibration.n_calibration=4", "method.calibration.n_heldout=2",
             "method.calibration.seqlen=64", "method.calibration.steps=2", "method.calibration.select_every=1",
             "method.calibration.alphas=[0.0]", "model.eval_seqlen=256"]  # fmt: skip
    run(run_config(*tiny_job(tmp_path, *small, "precision=c2r4")))

    def captured(*args, **kwargs):
        raise AssertionError("a run whose units were all held captured a teacher")

    monkeypatch.setattr("quantmla.methods.prepare.capture_inputs", captured)
    assembled = run(run_config(*tiny_job(tmp_path, *small, "precision.name=c2r16")))["metrics"]
    monkeypatch.undo()
    refitted = run(run_config(*tiny_job(tmp_path, *small, "precision.name=c2r16", "force=true",
                                        "method.calibration.reuse_units=false")))["metrics"]  # fmt: skip
    (source,) = assembled["method/report"]["reused"]
    assert assembled["method/report"]["reused"] == {source: [f"{i}/content" for i in range(6)]}
    assert "reused" not in refitted["method/report"]
    assert assembled["ppl/wikitext2"] == refitted["ppl/wikitext2"]


def test_a_stopped_fit_with_held_units_resumes_to_the_same_transforms(
    ctx, c2r4_fit, tmp_path, monkeypatch
):
    """The saved state leaves the held units out (the rerun job brings them again): a stopped
    partial fit resumes to the uninterrupted one's transforms and selections."""
    held = {
        (i, "rope"): Unit(t.rope, "a.safetensors", 0.5, 2) for i, t in enumerate(c2r4_fit.layers)
    }
    cal = dataclasses.replace(CAL, steps=6)

    def job(resume=None):
        return MethodJob(ctx.modules, C2R4, cal, ctx, seed=0, resume_path=resume, fixed=held)

    whole = quantmla(job())
    with fit_stopped_at(monkeypatch, 3):
        quantmla(job(tmp_path / "fit.ckpt"))
    resumed = quantmla(job(tmp_path / "fit.ckpt"))
    assert resumed.report["resumed_at_step"] == 2
    assert resumed.report["best_step"] == whole.report["best_step"]
    assert [b["rope"] for b in whole.report["best_step"]] == [2, 2]  # the held units' own
    for got, want, source in zip(resumed.layers, whole.layers, c2r4_fit.layers):
        assert_same(got.content, want.content)
        assert_same(got.rope, source.rope)


def test_the_output_rope_objective_fits_only_the_rope_units_differently(ctx, c2r4_fit, tmp_path):
    """`rope_objective=output` (the attention output with the RoPE path alone quantized) changes
    the RoPE units only: the content units are the QK-objective fit's, bit for bit, and are taken
    from its artifact; its RoPE units are not."""

    from quantmla.calibration.module import QuantMLACalibration
    from quantmla.methods.smoothquant import heldout_output_nmse
    from quantmla.transforms import LayerTransforms, RopeTransform

    output = dataclasses.replace(CAL, rope_objective="output")
    module = QuantMLACalibration(ctx, [LayerTransforms()] * 2, C16R4, output)
    _, rope = module.losses(1, ctx.heldout, ste=False)  # identity transforms: the native cache's
    identity = RopeTransform.identity(ctx.modules[1].qk_rope_head_dim)
    native = heldout_output_nmse(ctx, 1, C16R4, rope=identity, batch_size=len(ctx.heldout))
    assert native > 0
    assert float(rope) == pytest.approx(native, rel=1e-5)
    assert_rope_units_alone_differ(ctx, c2r4_fit, tmp_path, output, {"rope_objective": "output"})


def assert_rope_units_alone_differ(ctx, c2r4_fit, tmp_path, cal, settings):
    """A fit under `cal` (a RoPE-path setting off its default, `settings` in an artifact's
    metadata): its content units are the default fit's bit for bit, its RoPE units are not, and
    of a default artifact it is given the content units alone."""
    import json

    fitted = quantmla(MethodJob(ctx.modules, C2R4, cal, ctx, seed=0))
    for got, default in zip(fitted.layers, c2r4_fit.layers):
        assert_same(got.content, default.content)
        assert not torch.equal(got.rope.scales, default.rope.scales)

    def metadata(fit_settings):
        return {"model": "m", "method": "quantmla", "seed": "0", "precision": "c2r4",
                "quantizer": C2R4.key, "calibration": json.dumps(fit_settings)}  # fmt: skip

    save_artifact(dataclasses.replace(c2r4_fit, metadata=metadata({})), tmp_path / "a.safetensors")
    units = saved_units(tmp_path, metadata(settings), [C2R4, C2R4])
    assert set(units) == {(0, "content"), (1, "content")}


@needs_tiny
def test_a_fits_captured_activations_are_freed_before_the_evaluation(tmp_path, monkeypatch):
    """Once the fit is done no calibration context (captured inputs, kept teacher outputs) is
    alive: the evaluation runs without the calibration's memory."""
    import gc

    from quantmla.calibration.context import CalibrationContext
    from quantmla.methods import prepare as method_prepare
    from quantmla.run import run

    def contexts() -> set[int]:
        return {id(o) for o in gc.get_objects() if isinstance(o, CalibrationContext)}

    before, alive = contexts(), []  # other tests' (module fixtures) stay alive
    build = method_prepare.prepare_method

    def watched(*args, **kwargs):
        result = build(*args, **kwargs)
        alive.append(len(contexts() - before))
        return result

    monkeypatch.setattr(method_prepare, "prepare_method", watched)
    small = ["method=quantmla", "method.calibration.n_calibration=4", "method.calibration.n_heldout=2",
             "method.calibration.seqlen=64", "method.calibration.steps=2", "method.calibration.select_every=1",
             "method.calibration.alphas=[0.0]", "model.eval_seqlen=256", "precision=c4r4"]  # fmt: skip
    run(run_config(*tiny_job(tmp_path, *small)))
    assert alive == [0]


def test_rope_positions_fits_only_the_rope_units_differently(ctx, c2r4_fit, tmp_path):
    """`rope_positions` (the RoPE objective on sequences moved to seeded later starts) changes the
    RoPE units only: the content units are the default fit's, bit for bit, and an artifact's
    content units are taken for it, its RoPE units not."""

    from quantmla.calibration.module import rope_offsets

    moved = dataclasses.replace(CAL, rope_positions=400)
    offsets = rope_offsets(ctx, 400, seed=0)
    assert offsets.shape == (6,) and offsets.min() >= 0 and offsets.max() <= 400 - 48
    assert torch.equal(offsets, rope_offsets(ctx, 400, seed=0)) and rope_offsets(ctx, 0, 0) is None
    assert_rope_units_alone_differ(ctx, c2r4_fit, tmp_path, moved, {"rope_positions": 400})


def test_rope_hadamard_scores_the_rotated_key_and_fits_only_the_rope_units(ctx, c2r4_fit, tmp_path):
    """`rope_hadamard` (an online Hadamard after the fused per-pair transforms): the RoPE objective
    is the brute-force causal QK-score error of (q H)·Q(k H) against q·k; the fit's result runs H
    online, its content units are the default fit's and an artifact gives it those alone."""
    from quantmla.calibration.module import QuantMLACalibration
    from quantmla.quant import qdq_rope
    from quantmla.transforms import LayerTransforms, hadamard

    rotated = dataclasses.replace(CAL, rope_hadamard=True)
    module = QuantMLACalibration(ctx, [LayerTransforms()] * 2, C16R4, rotated)
    rope = module.losses(1, ctx.heldout, ste=False)[1].detach()  # identity per-pair transforms
    proj, _ = ctx.project(1, ctx.heldout)
    q, k = proj.q_rot.double(), proj.k_rot.double()  # (B, H, n, r), (B, n, r)
    h = hadamard(k.shape[-1])
    k_hat = qdq_rope(C16R4, (proj.k_rot @ h.to(proj.k_rot)).float()).double()
    causal = torch.ones(k.shape[1], k.shape[1], dtype=torch.bool).tril()
    exact = torch.einsum("bhtr,bjr->bhtj", q, k)[..., causal]
    error = torch.einsum("bhtr,bjr->bhtj", q @ h, k_hat)[..., causal] - exact
    assert float(rope) == pytest.approx(float(error.pow(2).sum() / exact.pow(2).sum()), rel=1e-4)
    plain = QuantMLACalibration(ctx, [LayerTransforms()] * 2, C16R4, CAL)
    unrotated = plain.losses(1, ctx.heldout, ste=False)[1].detach()
    assert abs(float(rope) - float(unrotated)) > 1e-3 * float(unrotated)

    fitted = quantmla(MethodJob(ctx.modules, C2R4, rotated, ctx, seed=0))
    assert fitted.rope_online == "hadamard" and c2r4_fit.rope_online is None
    smoothed = smoothquant(MethodJob(ctx.modules, C16R4, rotated, ctx, seed=0))
    assert smoothed.rope_online == "hadamard"
    assert_rope_units_alone_differ(ctx, c2r4_fit, tmp_path, rotated, {"rope_hadamard": True})
    assert assemble("quantmla", 2, {}, "hadamard").rope_online == "hadamard"
