"""CUDA only (`make gpu-check`): the tiny model on the GPU computes what it computes on the CPU."""

import pytest
import torch

from tests.conftest import TINY_MLA, needs_tiny

pytestmark = [pytest.mark.gpu, needs_tiny]


@pytest.mark.parametrize("backend", ["simulator", "packed"])
def test_generation_on_the_gpu_equals_the_cpu(backend):
    """fp32 weights on both devices: C4R4 logits within 1e-3 of their scale, same greedy tokens
    (the packed backend runs the Triton kernels on CUDA and the reference on the CPU)."""
    from transformers import DynamicCache

    from quantmla import patch_model
    from quantmla.models.loading import load_pretrained

    outs = {}
    for device in ("cpu", "cuda"):
        model, tokenizer = load_pretrained(str(TINY_MLA), "float32", device=device)
        patch_model(model, "c4r4", sink=4, recent=16, backend=backend)
        ids = tokenizer("The history of the city", return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            generated = model.generate(
                ids,
                max_new_tokens=16,
                do_sample=False,
                cache=DynamicCache(config=model.config),
                output_logits=True,
                return_dict_in_generate=True,
            )
        outs[device] = (generated.sequences.cpu(), torch.stack(generated.logits).cpu())
    (cpu_tokens, cpu_logits), (gpu_tokens, gpu_logits) = outs["cpu"], outs["cuda"]
    assert torch.equal(cpu_tokens, gpu_tokens)
    scale = cpu_logits.abs().max()
    assert float((gpu_logits - cpu_logits).abs().max() / scale) < 1e-3


def test_native_fp8_checkpoint_runs_and_matches_the_dequantized_one(tmp_path):
    """The GPU half of the FP8 path: transformers' FP8 layers (E4M3 weights, 128 × 128 scales,
    576-row kv_a_proj_with_mqa included) against our dequantized load; adapters and the simulator
    on the native model; fusion through its FP8 layers."""
    from experiments.make_fp8_checkpoint import tiny_v3, write_fp8
    from quantmla import patch_model
    from quantmla.methods.base import MethodResult, apply_method
    from quantmla.models.adapters import get_adapter
    from quantmla.models.fp8 import dequantize_blocks
    from quantmla.models.loading import load_pretrained
    from quantmla.transforms import ContentTransform, LayerTransforms
    from tests.test_fp8 import e4m3_bound, tokenizer_files

    write_fp8(tiny_v3(), tmp_path / "fp8")
    tokenizer_files(tmp_path / "fp8")
    native, _ = load_pretrained(str(tmp_path / "fp8"), "bfloat16", device="cuda", fp8="native")
    plain, _ = load_pretrained(str(tmp_path / "fp8"), "bfloat16", device="cuda", fp8="dequantize")
    kv_a = native.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert kv_a.weight.dtype == torch.float8_e4m3fn and kv_a.weight_scale_inv.shape == (5, 8)
    ids = torch.randint(
        0, 512, (1, 48), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    with torch.no_grad():
        a, b = native(ids).logits.float(), plain(ids).logits.float()
        patch_model(native, "c4r4", sink=4, recent=8)
        c = native(ids).logits.float()
    assert float((a - b).norm() / b.norm()) < 0.1  # FP8 activations too, in the native matmuls
    assert torch.isfinite(c).all()
    adapter = get_adapter(native.config)
    module = adapter.attention_modules(native)[0]
    before = dequantize_blocks(module.kv_b_proj.weight.data, module.kv_b_proj.weight_scale_inv.data)
    scale = torch.rand(512, generator=torch.Generator().manual_seed(1)).double() + 0.5
    layers = [
        LayerTransforms(ContentTransform(torch.eye(512, dtype=torch.float64), scale), None)
    ] * 2
    apply_method(native, adapter, MethodResult("test", layers))
    gamma = adapter.attention_modules(plain)[0].kv_a_layernorm.weight.double().cpu()
    expected = (before.double().cpu() * gamma / scale).float()  # kv_b_proj ← W Γ S⁻¹ (R = I)
    w = module.kv_b_proj
    assert w.weight.dtype == torch.float8_e4m3fn
    w_hat = dequantize_blocks(w.weight.data, w.weight_scale_inv.data).cpu()
    assert (
        (w_hat.double() - expected.double()).abs()
        <= e4m3_bound(expected, w.weight_scale_inv.data.cpu()) + 1e-6
    ).all()


@pytest.mark.parametrize("precision", ["c4r4", "c2r4"])
def test_the_serving_backends_cuda_path_equals_its_cpu_path(precision):
    """quantmla.serving on vLLM-shaped tensors: Triton writer + decode on CUDA (bf16 dots) vs the
    torch path on the CPU, V2-Lite geometry (512 + 64, 16 heads), 16-token blocks."""
    from quantmla.serving.paged_attention import decode_latent, write_packed
    from quantmla.serving.settings import ServeSettings

    lay = ServeSettings(precision=precision).layout(512, 64, 16)
    gen = torch.Generator().manual_seed(0)
    lengths = [7, 300, 1500]
    table = torch.randperm(200, generator=gen)[: 3 * 94].view(3, 94).to(torch.int32)
    slots = torch.cat([table[b, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16
                       for b, n in enumerate(lengths)])  # fmt: skip
    c, k = (
        torch.randn(slots.shape[0], 512, generator=gen),
        torch.randn(slots.shape[0], 64, generator=gen),
    )
    q, qr = (
        torch.randn(3, 16, 512, generator=gen) * 0.05,
        torch.randn(3, 16, 64, generator=gen) * 0.05,
    )
    prot = torch.randn(3, 132, 576, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = {}
    for device, kernel in (("cpu", "torch"), ("cuda", "triton")):
        storage = torch.zeros(200, lay.page_bytes(), dtype=torch.uint8, device=device)
        write_packed(storage, lay, slots.to(device), c.to(device), k.to(device), kernel)
        args = [t.to(device) for t in (q, qr)] + [0.1, table.to(device), lens.to(device), lay]
        held = torch.arange(3, device=device)  # each request's protection slot
        out[device] = decode_latent(*args, storage, prot.to(device), held, kernel).cpu()
        if device == "cpu":
            packed = storage
        else:
            assert torch.equal(storage.cpu(), packed)  # the writer is bit-identical
    torch.testing.assert_close(out["cuda"], out["cpu"], rtol=2e-2, atol=2e-2)
