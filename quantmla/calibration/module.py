"""QuantMLA calibration as one Lightning fit over all layers (docs/method.md §4).

Trainable parameters are the transforms only: per layer a Cayley parameter P (R_C = cayley(P),
identity at P = 0) and log(s_C / m), m the latent's magnitude (`latent_magnitude`); per RoPE pair
an angle θ_i and log s_i. Scales are m·exp(clip(log(s_C / m), −2, 2)) and exp(clip(log s_i, −2, 2)).
Each step, every layer computes its two path-isolated objectives on the same batch of calibration
sequences (content: normalised post-o_proj output MSE with RoPE exact; RoPE: normalised
positional-QK error over all causal pairs and heads with content exact, or with
`rope_objective=output` the output MSE with the RoPE path alone quantized; with `rope_positions`
each sequence's RoPE query and key moved to a seeded start position), with a
straight-through estimator on rounding and no BF16 protection. Layers and paths share no
parameters, so the summed loss trains them independently. Every `select_every` steps (and before
the first) the held-out objectives pick the best checkpoint per layer and path.

Choices (the paper's Table 7 is lost): Adam, lr 1e-3 for P, 1e-2 for angles and log-scales,
constant rate, batch 4 sequences, selection every 25 steps.
"""

from __future__ import annotations

import copy
import time

import lightning as L
import torch
from torch import nn

from quantmla.calibration.context import CalibrationContext
from quantmla.calibration.objectives import (
    content_qdq,
    layer_output,
    positional_output_loss,
    positional_qk_loss,
)
from quantmla.config import CalibrationConfig, calibrated_rope_online
from quantmla.metrics import nmse
from quantmla.spec import PATHS, QuantizerSpec, layer_spec
from quantmla.transforms import (
    ContentTransform,
    LayerTransforms,
    RopeTransform,
    cached_rope_matrices,
    cayley,
    latent_magnitude,
    online_rope_matrix,
)

LOG_SCALE_CLIP = 2.0


class LayerParameters(nn.Module):
    """One layer's learnable content and RoPE transforms."""

    def __init__(self, init: LayerTransforms, d_c: int, d_r: int, magnitude: float):
        super().__init__()
        self.magnitude = magnitude  # a plain float: a checkpoint's parameters are relative to it
        s_c = init.content.scale if init.content is not None else torch.full((d_c,), magnitude)
        s_p = init.rope.scales if init.rope is not None else torch.ones(d_r // 2)
        self.cayley = nn.Parameter(torch.zeros(d_c, d_c))
        self.log_content_scale = nn.Parameter((s_c.double() / magnitude).log().float())
        self.angles = nn.Parameter(torch.zeros(d_r // 2))
        self.log_rope_scale = nn.Parameter(s_p.float().log())

    def content(self) -> tuple[torch.Tensor, torch.Tensor]:
        relative = self.log_content_scale.clamp(-LOG_SCALE_CLIP, LOG_SCALE_CLIP).exp()
        return cayley(self.cayley), relative * self.magnitude

    def rope(self) -> RopeTransform:
        return RopeTransform(
            self.angles, self.log_rope_scale.clamp(-LOG_SCALE_CLIP, LOG_SCALE_CLIP).exp()
        )

    def transforms(self) -> LayerTransforms:
        with torch.no_grad():
            rotation, scale = self.content()
            rope = self.rope()
            return LayerTransforms(
                ContentTransform(rotation.double().cpu(), scale.double().cpu()),
                RopeTransform(
                    rope.angles.detach().double().cpu(), rope.scales.detach().double().cpu()
                ),
            )


def rope_offsets(ctx: CalibrationContext, positions: int, seed: int) -> torch.Tensor | None:
    """Per captured sequence, the seeded start its RoPE objective sees it at: uniform in
    [0, positions − seqlen] (`rope_positions`); None when 0 (the captured positions)."""
    if not positions:
        return None
    count, seqlen = ctx.store.inputs[0].shape[:2]
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, positions - seqlen + 1, (count,), generator=generator)


class QuantMLACalibration(L.LightningModule):
    def __init__(
        self,
        ctx: CalibrationContext,
        init: list[LayerTransforms],
        spec: QuantizerSpec | list[QuantizerSpec],  # one per layer: each trained at its own bits
        calibration: CalibrationConfig,
        init_report: dict | None = None,  # how `init` was found (saved with the fit's state)
        fixed: dict | None = None,  # (layer, path) → `reuse.Unit`: taken as is, never computed
        seed: int = 0,  # draws the RoPE objective's position offsets (`rope_positions`)
    ):
        super().__init__()
        self.ctx, self.spec, self.cal = ctx, spec, calibration
        self.init_report = init_report
        self.fixed = fixed or {}
        self.layers = nn.ModuleList(
            LayerParameters(
                t, m.kv_lora_rank, m.qk_rope_head_dim, latent_magnitude(ctx.gamma(layer))
            )
            for layer, (t, m) in enumerate(zip(init, ctx.modules))
        )
        self.best = [
            {path: self._fixed_entry(layer, path) or (float("inf"), None, -1) for path in PATHS}
            for layer in range(len(self.layers))
        ]
        self.history: list[dict] = []
        self.seconds_selection = 0.0  # of the fit's time, the held-out selections'
        self.rope_offsets = rope_offsets(ctx, calibration.rope_positions, seed)
        self.rope_online = online_rope_matrix(  # run after the fused per-pair transforms
            calibrated_rope_online(calibration), ctx.modules[0].qk_rope_head_dim
        )

    # -- objectives ---------------------------------------------------------------------------
    def _layout(self, layer: int) -> str:
        return self.ctx.adapter.geometry(self.ctx.modules[layer]).cache_pairs

    def losses(
        self, layer: int, index: torch.Tensor, ste: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(content, RoPE) objectives of one layer on sequences `index`; a unit that is taken as
        is or not quantized has none (0, nothing computed: its transform stays as it is)."""
        fit_content, fit_rope = self.fitted(layer)
        content = rope = torch.zeros((), device=self.ctx.device)
        if not (fit_content or fit_rope):
            return content, rope
        to_output = fit_rope and self.cal.rope_objective == "output"
        proj, y = self.ctx.project(layer, index, teacher=fit_content or to_output)
        params, spec = self.layers[layer], layer_spec(self.spec, layer)
        if fit_content:
            rotation, scale = params.content()
            c_hat = content_qdq(
                proj.c, self.ctx.gamma(layer), rotation.to(proj.c), scale.to(proj.c), spec, ste=ste
            )
            module = self.ctx.modules[layer]
            content = nmse(layer_output(module, self.ctx.adapter, proj, c=c_hat), y)
        if fit_rope:
            if self.rope_offsets is not None:
                proj = self.ctx.shifted(layer, proj, self.rope_offsets[index])
            matrices = cached_rope_matrices(params.rope(), self._layout(layer), self.rope_online)
            key, query = (m.to(proj.k_rot) for m in matrices)
            if to_output:
                module = self.ctx.modules[layer]
                rope = positional_output_loss(
                    module, self.ctx.adapter, proj, y, key, query, spec, ste=ste
                )
            else:
                rope = positional_qk_loss(proj.q_rot, proj.k_rot, key, query, spec, ste=ste)
        return content, rope

    def fitted(self, layer: int) -> tuple[bool, bool]:
        """Whether this fit computes the layer's (content, RoPE) unit: quantized and not fixed."""
        spec = layer_spec(self.spec, layer)
        return tuple(
            spec.path_key(path) is not None and (layer, path) not in self.fixed for path in PATHS
        )

    def _fixed_entry(self, layer: int, path: str):
        """A fixed unit's selection entry: (its held-out value, its transforms, its step)."""
        unit = self.fixed.get((layer, path))
        if unit is None:
            return None
        return unit.heldout, LayerTransforms(**{path: unit.transform}), unit.step

    def training_step(self, index, _):
        total = 0.0
        for layer in range(len(self.layers)):
            losses = self.losses(layer, index, ste=True)
            for path, fitted, value in zip(PATHS, self.fitted(layer), losses):
                if fitted:  # a held or unquantized unit has no curve in this fit
                    self.log(f"calib/layer{layer}/{path}", value)
            total = total + sum(losses)
        self.log("calib/loss", total, prog_bar=True)
        return total

    # -- held-out checkpoint selection --------------------------------------------------------
    @torch.no_grad()
    def select(self) -> None:
        started = time.time()
        step = self.global_step
        record = {"step": step}
        for layer, params in enumerate(self.layers):
            sums = torch.zeros(2)
            batches = self.ctx.heldout.split(self.cal.batch_size)
            for index in batches:
                sums += torch.tensor([float(v) for v in self.losses(layer, index, ste=False)])
            means = sums / len(batches)
            for path, value in zip(PATHS, means.tolist()):
                if (layer, path) in self.fixed:
                    continue
                record[f"layer{layer}/{path}"] = value
                if value < self.best[layer][path][0]:
                    self.best[layer][path] = (value, copy.deepcopy(params.transforms()), step)
        self.history.append(record)
        self.seconds_selection += time.time() - started
        if self.logger is not None:
            self.logger.log_metrics(
                {f"heldout/{k}": v for k, v in record.items() if k != "step"}, step=step
            )

    def on_train_start(self) -> None:
        if not self.history or self.history[-1]["step"] != self.global_step:  # not on a resume
            self.select()

    # -- a stopped fit resumes: the selection state and the α search's report travel in the
    # checkpoint (tensors and plain values only) ---
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        def plain(entry):
            value, t, step = entry
            tensors = (
                (t.content.rotation, t.content.scale, t.rope.angles, t.rope.scales) if t else ()
            )
            return {"value": value, "step": step, "tensors": list(tensors)}

        checkpoint["quantmla"] = {  # fixed units come with the job again, not in the state
            "best": [
                {p: plain(b[p] if (i, p) not in self.fixed else (None, None, -1)) for p in b}
                for i, b in enumerate(self.best)
            ],
            "history": self.history,
            "init": self.init_report,  # a resumed fit need not search for its start again
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        def back(entry):
            t = entry["tensors"]
            transforms = (
                LayerTransforms(ContentTransform(t[0], t[1]), RopeTransform(t[2], t[3]))
                if t
                else None
            )
            return (entry["value"], transforms, entry["step"])

        state = checkpoint["quantmla"]
        self.best = [
            {p: self._fixed_entry(i, p) or back(b[p]) for p in b}
            for i, b in enumerate(state["best"])
        ]
        self.history = state["history"]

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if (
            self.global_step % self.cal.select_every == 0
            or self.global_step == self.trainer.max_steps
        ):
            self.select()

    def best_transforms(self) -> list[LayerTransforms]:
        return [LayerTransforms(b["content"][1].content, b["rope"][1].rope) for b in self.best]

    def configure_optimizers(self):
        rotations = [p.cayley for p in self.layers]
        others = [q for p in self.layers for q in (p.log_content_scale, p.angles, p.log_rope_scale)]
        return torch.optim.Adam(
            [
                {"params": rotations, "lr": self.cal.lr_rotation},
                {"params": others, "lr": self.cal.lr_scale},
            ]
        )
