"""Per-layer attention-output NMSE of the quantized cache: every layer fed the *teacher's* inputs,
so each number isolates that layer's cache error (‖Ŷ − Y‖² / ‖Y‖², post-o_proj, protection on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.calibration.capture import ActivationStore, capture_inputs, map_position_embeddings


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
        """Teacher inputs and outputs, with the model as it is now (call before quantizing)."""
        store = capture_inputs(model, modules, sequences, batch_size)
        return cls(store, cls._outputs(modules, store))

    def measure(self, modules) -> list[float]:
        outputs = self._outputs(modules, self.store)
        return [
            float((o - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-30))
            for o, t in zip(outputs, self.teacher)
        ]
