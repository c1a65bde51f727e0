"""Normalised MSE, the one error measure of the project (‖Ŷ − Y‖² / ‖Y‖²): per tensor
(differentiable, for calibration objectives) and accumulated over batches."""

from __future__ import annotations

import torch

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
