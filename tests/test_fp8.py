"""FP8 block-quantized checkpoints (DeepSeek-V3 format) on CPU: the project's tiny FP8 checkpoint,
dequantize-on-load, adapters and the simulator on it, and fusion through FP8 weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

from quantmla.errors import ConfigError
from quantmla.models.fp8 import (
    dequantize_blocks,
    dequantized_for_fusion,
    fp8_eligible,
    quantize_blocks,
)
from quantmla.models.loading import use_padded_sdpa
from tests.conftest import REPO


def e4m3_bound(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Per element: half an E4M3 step — 2⁻⁴ of a normal value, 2⁻¹⁰ below 2⁻⁶ (subnormals) —
    times its block's scale."""
    rows, cols = w.shape
    s = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    v = w.double().abs() / s.double()
    return torch.maximum(v * 2.0**-4, torch.full_like(v, 2.0**-10)) * s.double()


@pytest.mark.parametrize("shape", [(576, 1024), (128, 128), (130, 257), (1, 5)])
def test_block_quantization_error_is_within_half_an_e4m3_step(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[1])  # wide dynamic range
    q, scale_inv = quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    w_hat = dequantize_blocks(q, scale_inv)
    assert ((w_hat.double() - w.double()).abs() <= e4m3_bound(w, scale_inv) + 1e-30).all()
    # every block's largest magnitude maps to ±448 exactly
    assert dequantize_blocks(q, scale_inv).abs().max() == pytest.approx(w.abs().max(), rel=0)


def test_block_quantization_refuses_non_finite_weights():
    w = torch.ones(4, 4)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_blocks(w)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    from experiments.make_fp8_checkpoint import tiny_v3, write_fp8

    root = tmp_path_factory.mktemp("fp8")
    model = tiny_v3()
    model.save_pretrained(root / "bf16")
    write_fp8(model, root / "fp8")
    tokenizer_files(root / "fp8")
    return root


def tokenizer_files(folder):
    """A tokenizer beside the weights (the loader loads one): the tiny model's, whose ids fit."""
    from transformers import AutoTokenizer

    from tests.conftest import TINY_MLA

    AutoTokenizer.from_pretrained(str(TINY_MLA)).save_pretrained(folder)


def test_the_checkpoint_is_in_the_published_format(fp8_checkpoint):
    from quantmla.models.loading import config_from_dict

    raw = json.loads((fp8_checkpoint / "fp8" / "config.json").read_text())
    published = json.loads((REPO / "assets/model-configs/deepseek-v3-base.json").read_text())
    assert raw["quantization_config"] == published["quantization_config"]
    config = config_from_dict(raw, keep_quantization=True)
    assert config.quantization_config["weight_block_size"] == [128, 128]
    assert config.kv_lora_rank == 512 and config.qk_rope_head_dim == 64  # real MLA dims
    assert not hasattr(config_from_dict(raw), "quantization_config") or not getattr(
        config_from_dict(raw), "quantization_config", None
    )
    tensors = load_file(str(fp8_checkpoint / "fp8" / "model.safetensors"))
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert tensors[kv_a].dtype == torch.float8_e4m3fn
    assert tensors[kv_a.replace(".weight", ".weight_scale_inv")].shape == (
        5,
        8,
    )  # 576 rows: 4.5 blocks
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.mlp.gate.weight"].dtype != torch.float8_e4m3fn
    scales = [k for k in tensors if k.endswith("_scale_inv")]
    assert scales and all(
        fp8_eligible(k.replace("_scale_inv", ""), tensors[k.replace("_scale_inv", "")].shape)
        for k in scales
    )


def test_transformers_own_dequantize_stops_on_a_partial_block(fp8_checkpoint):
    """Stated limitation (transformers 5.24): its on-load dequantization requires whole blocks, so
    DeepSeek-V3's 576-row kv_a_proj_with_mqa (scale grid 5 × 56) fails; ours does not."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    with pytest.raises(RuntimeError, match="automatic conversion"):
        AutoModelForCausalLM.from_pretrained(
            str(fp8_checkpoint / "fp8"), quantization_config=FineGrainedFP8Config(dequantize=True)
        )


@pytest.fixture(scope="module")
def loaded(fp8_checkpoint):
    """(the FP8 checkpoint loaded dequantized, the BF16 model it came from, that BF16 model with
    every eligible weight FP8 round-tripped in memory — an independent path to the same weights)."""
    import copy

    from transformers import AutoModelForCausalLM

    from quantmla.models.loading import load_pretrained

    model, _ = load_pretrained(str(fp8_checkpoint / "fp8"), fp8="dequantize")
    reference = AutoModelForCausalLM.from_pretrained(
        str(fp8_checkpoint / "bf16"), dtype=torch.bfloat16
    ).eval()
    use_padded_sdpa(reference)  # the attention load_pretrained gives an MLA model: same kernel
    round_tripped = copy.deepcopy(reference)
    with torch.no_grad():
        for name, p in round_tripped.named_parameters():
            if p.ndim == 3 and fp8_eligible(name + ".weight", p.shape):  # fused experts
                p.copy_(torch.stack([dequantize_blocks(*quantize_blocks(e)) for e in p]))
            elif fp8_eligible(name, p.shape):
                p.copy_(dequantize_blocks(*quantize_blocks(p)))
    return model, reference, round_tripped


def test_dequantize_on_load_equals_the_bf16_model_within_fp8_error(fp8_checkpoint, loaded):
    model, reference, round_tripped = loaded
    tensors = load_file(str(fp8_checkpoint / "fp8" / "model.safetensors"))
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    ours = dequantize_blocks(tensors[kv_a], tensors[kv_a.replace(".weight", ".weight_scale_inv")])
    loaded_w = model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight
    assert loaded_w.dtype == torch.bfloat16 and torch.equal(loaded_w, ours.to(torch.bfloat16))
    ref_w = reference.model.layers[0].self_attn.kv_a_proj_with_mqa.weight
    scale = tensors[kv_a.replace(".weight", ".weight_scale_inv")]
    assert ((ours.double() - ref_w.double()).abs() <= e4m3_bound(ref_w.float(), scale)).all()
    # the whole model: exactly the BF16 model with every eligible weight FP8 round-tripped
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = model(ids).logits.float(), round_tripped(ids).logits.float()
        c = reference(ids).logits.float()
    assert torch.equal(a, b)
    assert float((a - c).norm() / c.norm()) < 0.25  # random-init weights: FP8 error ~13 % here


def test_native_fp8_without_cuda_is_one_line(fp8_checkpoint):
    from quantmla.models.loading import load_pretrained

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the native path is `make gpu-check`'s")
    with pytest.raises(ConfigError, match="model.fp8='native'.*CUDA"):
        load_pretrained(str(fp8_checkpoint / "fp8"), fp8="native")


def test_adapter_and_simulator_run_on_the_dequantized_checkpoint(loaded):
    from quantmla import patch_model, unpatch_model
    from quantmla.models.adapters import get_adapter

    model, _, round_tripped = loaded
    assert len(get_adapter(model.config).attention_modules(model)) == 2
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (model, round_tripped):
        with torch.no_grad():
            bf16 = patch_model(m, "bf16")(ids).logits.float()
            c4r4 = patch_model(m, "c4r4", sink=4, recent=8)(ids).logits.float()
            unpatch_model(m)
        assert torch.isfinite(c4r4).all() and not torch.equal(bf16, c4r4)
        outs.append(c4r4)
    assert torch.equal(outs[0], outs[1])


def test_fusion_through_fp8_weights_is_within_fp8_error(loaded):
    """Dequantize → fuse → requantize (same 128 × 128 blocks) against the same fusion of the
    dequantized float weights: every element within half an E4M3 step of its new block."""
    import copy

    from quantmla.methods.base import MethodResult, apply_method
    from quantmla.models.adapters import get_adapter
    from quantmla.simulator import patch_model
    from quantmla.transforms import ContentTransform, LayerTransforms, RopeTransform, cayley

    model = loaded[0]
    float_model = copy.deepcopy(model).float()
    fp8_model = copy.deepcopy(float_model)
    adapter = get_adapter(model.config)
    names = ("kv_a_proj_with_mqa", "kv_b_proj", "q_b_proj")
    for module in adapter.attention_modules(fp8_model):  # FP8 linears as transformers holds them
        for name in names:
            linear = getattr(module, name)
            q, scale_inv = quantize_blocks(linear.weight.data)
            linear.weight = torch.nn.Parameter(q, requires_grad=False)
            linear.weight_scale_inv = torch.nn.Parameter(scale_inv, requires_grad=False)
            linear.block_size = (128, 128)
    for module in adapter.attention_modules(float_model):  # the same starting weights
        for name in names:
            linear = getattr(module, name)
            q, scale_inv = quantize_blocks(linear.weight.data)
            linear.weight.data = dequantize_blocks(q, scale_inv)
    g = torch.Generator().manual_seed(3)
    layers = [
        LayerTransforms(
            ContentTransform(
                cayley(0.05 * torch.randn(512, 512, generator=g)).double(),
                torch.rand(512, generator=g).double() + 0.5,
            ),
            RopeTransform(
                torch.randn(32, generator=g).double(), torch.rand(32, generator=g).double() + 0.5
            ),
        )
        for _ in range(2)
    ]
    for m in (float_model, fp8_model):
        patch_model(m, "bf16")
        apply_method(m, adapter, MethodResult("test", layers))
    for a, b in zip(adapter.attention_modules(float_model), adapter.attention_modules(fp8_model)):
        for name in names:
            fused, linear = getattr(a, name).weight.data, getattr(b, name)
            assert linear.weight.dtype == torch.float8_e4m3fn
            w_hat = dequantize_blocks(linear.weight.data, linear.weight_scale_inv.data)
            assert (
                (w_hat.double() - fused.double()).abs()
                <= e4m3_bound(fused, linear.weight_scale_inv.data) + 1e-12
            ).all(), name
    with dequantized_for_fusion(adapter.attention_modules(fp8_model)[0]) as linears:
        assert len(linears) == 3 and all(lin.weight.dtype == torch.float32 for lin in linears)
