"""Per-layer access to captured teacher activations: projections, teacher outputs, statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from quantmla.calibration.objectives import layer_output
from quantmla.errors import QuantMLAError
from quantmla.models.adapters import MLAAdapter, MLAProjections
from quantmla.models.capture import ActivationStore, map_position_embeddings
from quantmla.transforms.core import pair_indices, pair_matrix

TEACHER_BLOCK = 4  # sequences per teacher forward when the outputs are kept


@dataclass
class CalibrationContext:
    """The frozen model, its MLA modules and the captured inputs of calibration + held-out sequences."""

    model: nn.Module
    adapter: MLAAdapter
    modules: list[nn.Module]
    store: ActivationStore
    calibration: torch.Tensor  # sequence indices into the store
    heldout: torch.Tensor
    # keep each sequence's teacher output after its first use (host memory: the store's size
    # again) rather than recompute it at every step and selection (a fifth of a fit's step)
    keep_teacher: bool = False
    _teacher: dict = field(default_factory=dict, init=False, repr=False)  # layer → (outputs, kept)
    _angles: dict = field(default_factory=dict, init=False, repr=False)  # layer → RoPE pair angles

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def gamma(self, layer: int) -> torch.Tensor:
        gamma = self.modules[layer].kv_a_layernorm.weight.detach()
        if (gamma == 0).any():
            raise ValueError(
                f"layer {layer}: kv_a_layernorm has zero weights; the content transform needs Γ invertible"
            )
        return gamma

    def position_embeddings(self, layer: int, length: int):
        return map_position_embeddings(
            self.store.position_embeddings[layer], lambda p: p[:, :length].to(self.device)
        )

    @torch.no_grad()
    def project(
        self, layer: int, index: torch.Tensor, teacher: bool = True
    ) -> tuple[MLAProjections, torch.Tensor | None]:
        """The layer's projections and (`teacher`) BF16-teacher attention output for sequences `index`."""
        module = self.modules[layer]
        h = self.store.inputs[layer][index].to(self.device)
        proj = self.adapter.project(module, h, self.position_embeddings(layer, h.shape[1]))
        return proj, self._teacher_output(layer, index, proj) if teacher else None

    def _teacher_output(self, layer: int, index: torch.Tensor, proj: MLAProjections):
        """Recomputed, or (`keep_teacher`) read from memory, each sequence's output computed once
        in its aligned block of TEACHER_BLOCK sequences: the same numbers in whatever order the
        sequences are asked for (a resumed fit ends as an uninterrupted one)."""
        module = self.modules[layer]
        if not self.keep_teacher:
            return layer_output(module, self.adapter, proj)
        n = self.store.inputs[layer].shape[0]
        outputs, kept = self._teacher.setdefault(layer, (None, torch.zeros(n, dtype=torch.bool)))
        for block in sorted({int(i) // TEACHER_BLOCK for i in index if not kept[i]}):
            rows = torch.arange(block * TEACHER_BLOCK, min(n, (block + 1) * TEACHER_BLOCK))
            y = layer_output(module, self.adapter, self.project(layer, rows, teacher=False)[0])
            if outputs is None:
                outputs = torch.empty((n, *y.shape[1:]), dtype=y.dtype)
                self._teacher[layer] = (outputs, kept)
            outputs[rows], kept[rows] = y.cpu(), True
        return outputs[index].to(self.device)

    @torch.no_grad()
    def rope_angles(self, layer: int) -> torch.Tensor:
        """Per cache pair, the angle RoPE turns it by from one position to the next, probed through
        the adapter's own RoPE (so any family's layout and YaRN-style magnitudes are honoured):
        rope_{t+1}(x) = rope_t(x) · pair_matrix(angles) for row vectors."""
        module = self.modules[layer]
        d, layout = module.qk_rope_head_dim, self.adapter.geometry(module).cache_pairs
        dtype = module.o_proj.weight.dtype
        basis = torch.eye(d, dtype=dtype, device=self.device)[:, None, None, :].expand(d, 1, 2, d)
        pe = map_position_embeddings(
            self.store.position_embeddings[layer], lambda p: p[:, :2].to(self.device)
        )
        _, k = self.adapter.rope(module, basis.clone(), basis.clone(), pe)
        at = k.reshape(d, 2, d).double()  # row j at position p: rope_p(e_j)
        step = torch.linalg.solve(at[:, 0], at[:, 1])  # M_0⁻¹ M_1
        a, b = pair_indices(d, layout)
        angles = torch.atan2(step[a, b], step[a, a])
        if not torch.allclose(
            pair_matrix(angles, torch.ones_like(angles), layout), step, atol=1e-4
        ):
            raise QuantMLAError(
                f"layer {layer}: RoPE is not one rotation per {layout} pair of the cached key"
            )
        return angles

    def shifted(self, layer: int, proj: MLAProjections, offsets: torch.Tensor) -> MLAProjections:
        """`proj` with each sequence's RoPE query and key moved `offsets[i]` positions on: the same
        scores (a rotation of both), the key in the phases it has there."""
        if layer not in self._angles:
            self._angles[layer] = self.rope_angles(layer)
        angles, layout = self._angles[layer], self.adapter.geometry(self.modules[layer]).cache_pairs
        turns = torch.stack([
            pair_matrix(angles * float(s), torch.ones_like(angles), layout) for s in offsets
        ]).to(proj.k_rot)  # fmt: skip
        return replace(proj, q_rot=proj.q_rot @ turns[:, None], k_rot=proj.k_rot @ turns)

    @torch.no_grad()
    def channel_statistics(self, layer: int, quantile: float = 0.999, batch_size: int = 8):
        """99.9th-percentile |u_j| per content channel and per-pair norm of k_R, over calibration tokens."""
        u_abs, pair_norms = [], []
        a, b = pair_indices(
            self.modules[layer].qk_rope_head_dim,
            self.adapter.geometry(self.modules[layer]).cache_pairs,
        )
        gamma = self.gamma(layer)
        for index in self.calibration.split(batch_size):
            proj, _ = self.project(layer, index, teacher=False)
            u_abs.append((proj.c / gamma).abs().flatten(0, 1).float().cpu())
            k = proj.k_rot.flatten(0, 1).float().cpu()
            pair_norms.append(torch.sqrt(k[:, a] ** 2 + k[:, b] ** 2))
        return _quantile(torch.cat(u_abs), quantile), _quantile(torch.cat(pair_norms), quantile)


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """Per-column quantile (nearest rank) of a large (tokens, channels) matrix; torch.quantile caps input size."""
    k = max(1, min(x.shape[0], round(q * x.shape[0])))
    return x.kthvalue(k, dim=0).values
