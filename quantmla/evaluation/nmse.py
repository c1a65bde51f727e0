"""Normalised MSE, the one error measure of the project (‖Ŷ − Y‖² / ‖Y‖²), and the per-layer
attention-output NMSE of a quantized cache: every layer fed the *teacher's* inputs, so each number
isolates that layer's cache error (post-o_proj, protection on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.calibration.capture import ActivationStore, capture_inputs, map_position_embeddings

ENERGY_FLOOR = 1e-30  # a zero reference gives err / 1e-30, never NaN


def nmse(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """‖Ŷ − Y‖² / max(‖Y‖², 1e-30), in float32 or wider; differentiable (calibration objectives)."""
    y = y.to(torch.promote_types(y.dtype, torch.float32))
    return (y_hat.to(y.dtype) - y).pow(2).sum() / y.pow(2).sum().clamp_min(ENERGY_FLOOR)


class RunningNMSE:
    """NMSE over many batches: Σ‖Ŷ − Y‖² / Σ‖Y‖² (not a mean of per-batch ratios)."""

    def __init__(self):
        self.error = self.energy = 0.0

    def add(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        y = y.double()
        self.error += float((y_hat.double() - y).pow(2).sum())
        self.energy += float(y.pow(2).sum())

    @property
    def value(self) -> float:
        return self.error / max(self.energy, ENERGY_FLOOR)


@dataclass
class OutputNMSE:
    store: ActivationStore
    teacher: list[torch.Tensor]

    @staticmethod
    def _outputs(modules, store: ActivationStore) -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for i, module in enumerate(modules):
                device = module.o_proj.weight.device
                pe = map_position_embeddings(
                    store.position_embeddings[i], lambda p, d=device: p.to(d)
                )
                h = store.inputs[i].to(device)
                outs.append(
                    module(hidden_states=h, position_embeddings=pe, attention_mask=None)[0]
                    .float()
                    .cpu()
                )
        return outs

    @classmethod
    def capture(cls, model, modules, sequences: torch.Tensor, batch_size: int = 4) -> OutputNMSE:
        """Teacher inputs and outputs, with the model as it is now (call with quantization off)."""
        store = capture_inputs(model, modules, sequences, batch_size)
        return cls(store, cls._outputs(modules, store))

    def measure(self, modules) -> list[float]:
        outputs = self._outputs(modules, self.store)
        return [float(nmse(o, t)) for o, t in zip(outputs, self.teacher)]
