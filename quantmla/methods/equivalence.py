"""Fusion equivalence check (paper App. F.1): quantization off, original vs fused model.

Before fusion, `EquivalenceProbe.capture` records every MLA layer's attention output and the
end-to-end NLL on a few sequences; after fusion `check` recomputes them and raises
`FusionEquivalenceError` if any layer's relative error or the NLL drift exceeds float rounding
for the model's dtype. No second copy of the model is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quantmla.errors import QuantMLAError
from quantmla.metrics import nmse

# Relative per-layer output error and absolute NLL drift (nats) allowed per weight dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class FusionEquivalenceError(QuantMLAError):
    """The fused model does not compute the original function with quantization off."""


@dataclass
class EquivalenceProbe:
    sequences: torch.Tensor
    layer_outputs: list[torch.Tensor] = field(default_factory=list)
    nll: float = float("nan")

    @torch.no_grad()
    def _run(self, model, modules) -> tuple[list[torch.Tensor], float]:
        outputs = [None] * len(modules)
        hooks = [
            m.register_forward_hook(
                lambda mod, a, out, i=i: outputs.__setitem__(i, out[0].detach().float().cpu())
            )
            for i, m in enumerate(modules)
        ]
        try:
            x = self.sequences.to(next(model.parameters()).device)
            logits = model(x, use_cache=False).logits[:, :-1]
        finally:
            for h in hooks:
                h.remove()
        nll = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).item()
        return outputs, nll

    def capture(self, model, modules) -> EquivalenceProbe:
        self.layer_outputs, self.nll = self._run(model, modules)
        return self

    def check(self, model, modules) -> dict[str, float]:
        """Per-layer relative errors and NLL drift; raises above the dtype's rounding tolerance."""
        outputs, nll = self._run(model, modules)
        errors = [float(nmse(o, r).sqrt()) for o, r in zip(outputs, self.layer_outputs)]
        tol = TOLERANCE.get(next(model.parameters()).dtype, 1e-2)
        report = {
            "max_layer_rel_error": max(errors),
            "nll_drift": abs(nll - self.nll),
            "tolerance": tol,
        }
        worst = max(range(len(errors)), key=errors.__getitem__)
        if errors[worst] > tol or report["nll_drift"] > tol:
            raise FusionEquivalenceError(
                f"fused model is not equivalent with quantization off: layer {worst} attention-output "
                f"relative error {errors[worst]:.3g}, NLL drift {report['nll_drift']:.3g} (tolerance {tol:g}); "
                "check RoPE pairing, sub-block selection and compensation"
            )
        return report
