"""QuaRot† (docs/method.md §4): a fixed normalised Hadamard H_C on the content latent in
weightless-normalised coordinates (fused offline: z_C = u H_C · m, m = `latent_magnitude(Γ)`, Γ moved
to the consumers) and a fixed post-RoPE Hadamard H_P on the positional query and key, run online by
the simulator."""

from __future__ import annotations

import torch

from quantmla.methods.base import MethodJob, MethodResult
from quantmla.transforms import ContentTransform, LayerTransforms, hadamard, latent_magnitude


def quarot(job: MethodJob) -> MethodResult:
    layers = [
        LayerTransforms(
            ContentTransform(
                hadamard(m.kv_lora_rank),
                torch.full((m.kv_lora_rank,), latent_magnitude(m.kv_a_layernorm.weight)).double(),
            )
        )
        for m in job.modules
    ]
    return MethodResult("quarot", layers, rope_online="hadamard")
