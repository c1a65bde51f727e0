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
