"""The methods by name: the one list of method names, labels and needs (light: imports nothing heavy).

A method's `build(job)` returns a `MethodResult` (its transforms), or None for RTN. Adding a method
is one entry here plus its module; configs, validation and tables read this registry."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # as printed in tables
    calibrated: bool  # needs captured teacher activations and a `method.calibration` block
    target: str | None  # "module:function" taking a MethodJob; None: nothing to apply (RTN)
    description: str
    fully_fused: bool = True  # False: part of it runs online (an export alone cannot carry it)

    def build(self, job):
        if self.target is None:
            return None
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)(job)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("rtn", "RTN", False, None, "round-to-nearest on the native cache"),
        Method(
            "smoothquant",
            "SmoothQuant†",
            True,
            "quantmla.methods.smoothquant:smoothquant",
            "percentile channel scales, α per path on held-out output NMSE",
        ),
        Method(
            "quarot",
            "QuaRot†",
            False,
            "quantmla.methods.quarot:quarot",
            "Hadamard on the content latent (fused) and post-RoPE (online)",
            fully_fused=False,
        ),
        Method(
            "quantmla",
            "QuantMLA",
            True,
            "quantmla.methods.quantmla_method:quantmla",
            "learned content rotation+scale and RoPE-pair rotations+scales",
        ),
    )
}
