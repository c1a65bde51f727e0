"""Shared machinery of the two path analyses (docs/method.md §7–§8): one teacher capture per cell, each
layer's cached paths as a function of its inputs, and path-isolated QDQ error directions.

Cached coordinates are the declared ones: the content latent `c` as cached (c = uΓ) and the
post-RoPE key `k_R`. A path's output function maps its cached values to the post-`o_proj`
attention output of that layer with everything else exact (teacher forcing: every layer is fed the
BF16 model's own inputs). It uses the absorbed form, whose operations all have `torch.func`
batching rules (VJPs are vmapped over probes); the two forms compute the same function.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass

import torch

from quantmla.attention import attention_output, causal_regions
from quantmla.errors import ConfigError
from quantmla.models.adapters import MLAProjections
from quantmla.models.capture import ActivationStore, capture_inputs, map_position_embeddings
from quantmla.models.sizes import mla_layer_count
from quantmla.quant import qdq_content, qdq_rope
from quantmla.spec import UNQUANTIZED_BITS, QuantizerSpec

PATHS = ("C", "P")  # content latent, RoPE key
PATH_NAMES = {"C": "content", "P": "rope"}


@dataclass
class LayerCell:
    """One layer on one cell: its projections (teacher inputs), and the teacher output."""

    module: torch.nn.Module
    adapter: object
    proj: MLAProjections
    y: torch.Tensor  # (B, n, hidden), float

    def sequences(self, index: slice) -> LayerCell:
        """The same layer on a subset of the cell's sequences (outputs of different sequences do not
        interact, so J is block-diagonal over sequences)."""
        p = self.proj
        proj = MLAProjections(p.q_nope[index], p.q_rot[index], p.c[index], p.k_rot[index])
        return LayerCell(self.module, self.adapter, proj, self.y[index])

    def cached(self, path: str) -> torch.Tensor:
        return self.proj.c if path == "C" else self.proj.k_rot

    def output(self, path: str, value: torch.Tensor) -> torch.Tensor:
        """The layer's attention output with path `path`'s cached values replaced by `value`."""
        c = value if path == "C" else self.proj.c
        k_rot = value if path == "P" else self.proj.k_rot
        y = attention_output(
            self.module,
            self.adapter,
            self.proj.q_nope,
            self.proj.q_rot,
            causal_regions(c, k_rot),
            form="absorbed",
        )
        return y.to(torch.promote_types(y.dtype, torch.float32))


def cell_sequences(cfg, prepared) -> torch.Tensor:
    """The job's cell: `eval.n_sequences` seeded non-overlapping windows of its one dataset."""
    from quantmla.data import load_text, sensitivity_cell, tokenize

    (dataset,) = cfg.eval.datasets
    text = load_text(dataset, cfg.eval.splits[dataset], prepared.paths.data_dir)
    ids = tokenize(text, prepared.tokenizer)
    return sensitivity_cell(ids, cfg.seed, cfg.eval.n_sequences, cfg.eval.seqlen)


def capture_cell(model, modules, sequences: torch.Tensor, batch_size: int) -> ActivationStore:
    """Every MLA layer's input for the cell's sequences: one capture, reused by every layer."""
    return capture_inputs(model, modules, sequences, batch_size)


def run_study(cfg, prepared, prefix: str, study_layer) -> tuple[list[int], list, dict]:
    """Validate, capture the cell once with quantization off, call `study_layer(cell)` for every
    studied layer; returns the layers, their results and `<prefix>/` timing and memory metrics."""
    from tqdm.auto import tqdm

    modules = prepared.modules
    check_study_config(cfg, len(modules))
    layers = study_layers(cfg, len(modules))
    started = time.time()
    with prepared.unquantized():
        sequences = cell_sequences(cfg, prepared)
        store = capture_cell(prepared.model, modules, sequences, cfg.eval.batch_size)
    captured = time.time()
    results = [
        study_layer(layer_cell(store, layer, modules[layer], prepared.adapter))
        for layer in tqdm(layers, desc=prefix, leave=False)
    ]
    device = modules[0].o_proj.weight.device
    return (
        layers,
        results,
        {
            f"{prefix}/layers": layers,
            f"{prefix}/target_nmse": cfg.eval.target_nmse,
            f"{prefix}/seconds_capture": captured - started,
            f"{prefix}/seconds_per_layer": (time.time() - captured) / len(layers),
            f"{prefix}/peak_memory_mib": peak_memory_mib(device),
        },
    )


@torch.no_grad()
def layer_cell(store: ActivationStore, layer: int, module, adapter, dtype=None) -> LayerCell:
    """Projections and teacher output of one layer (optionally in `dtype`, e.g. float64)."""
    device = module.o_proj.weight.device
    h = store.inputs[layer].to(device)
    pe = map_position_embeddings(
        store.position_embeddings[layer], lambda p: p[:, : h.shape[1]].to(device)
    )
    if dtype is not None:
        h = h.to(dtype)
    proj = adapter.project(module, h, pe)
    cell = LayerCell(module, adapter, proj, y=None)
    cell.y = cell.output("C", proj.c)
    return cell


def qdq_error(spec: QuantizerSpec, path: str, x: torch.Tensor) -> torch.Tensor:
    """The path's own RTN quantization error Q(x) − x in its cached coordinates."""
    qdq = qdq_content if path == "C" else qdq_rope
    return (qdq(spec, x) - x).to(x.dtype)


def rescale_to_nmse(e: torch.Tensor, x: torch.Tensor, target: float) -> torch.Tensor:
    """e scaled so that ‖e‖² / ‖x‖² = target (over the whole cell)."""
    energy = float(e.double().pow(2).sum())
    if energy == 0.0:
        raise ValueError("zero error direction: this path is not quantized at the job's precision")
    return e * math.sqrt(target * float(x.double().pow(2).sum()) / energy)


def check(cfg, job) -> None:
    """eval.kind=sensitivity / probes, before anything loads (layers counted from the config)."""
    n_layers = mla_layer_count(job.model_config) if job.model_config is not None else None
    check_study_config(cfg, n_layers)
    spec = job.policy.spec
    for path in cfg.eval.paths:
        bits = spec.content_bits if path == "C" else spec.rope_bits
        if bits >= UNQUANTIZED_BITS:
            raise ConfigError(
                "precision",
                spec.precision,
                f"a precision that quantizes path {path} (e.g. c4r4): the study rescales that "
                "path's own quantization error, which is zero here",
            )


def check_study_config(cfg, n_layers: int | None = None) -> None:
    """One-line errors for the analysis settings, before any heavy work."""
    ev = cfg.eval
    for path in ev.paths:
        if path not in PATHS:
            raise ConfigError("eval.paths", path, PATHS)
    if not ev.target_nmse > 0:
        raise ConfigError("eval.target_nmse", ev.target_nmse, "a cache NMSE > 0")
    if ev.n_sequences < 1 or ev.seqlen < 2:
        raise ConfigError("eval.n_sequences/seqlen", (ev.n_sequences, ev.seqlen), ">= 1 and >= 2")
    if ev.kind == "probes" and (ev.probes < 2 or ev.probe_chunk < 1):
        raise ConfigError("eval.probes", ev.probes, "at least 2 probes (and probe_chunk >= 1)")
    if len(ev.datasets) != 1:
        raise ConfigError(
            "eval.datasets", ev.datasets, "exactly one dataset per job (a cell is dataset × seed)"
        )
    if n_layers is not None:
        for layer in ev.layers:
            if not 0 <= layer < n_layers:
                raise ConfigError("eval.layers", layer, f"layer indices in 0..{n_layers - 1}")


def study_layers(cfg, n_layers: int) -> list[int]:
    return list(cfg.eval.layers) or list(range(n_layers))


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10
