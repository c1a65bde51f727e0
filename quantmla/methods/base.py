"""What every method produces (per-layer transforms + an optional online RoPE matrix), how it is
applied to a model (offline fusion, then the equivalence check), and how it is saved as an artifact."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from quantmla.errors import QuantMLAError
from quantmla.models.adapters import MLAAdapter
from quantmla.models.fp8 import dequantized_for_fusion
from quantmla.simulator import layer_patch
from quantmla.spec import QuantizerSpec
from quantmla.tracking.store import stable_hash
from quantmla.transforms import (
    ContentTransform,
    LayerTransforms,
    RopeTransform,
    fuse_content,
    fuse_rope,
    online_rope_matrix,
)

if TYPE_CHECKING:
    from quantmla.calibration.context import CalibrationContext
    from quantmla.config import CalibrationConfig


class ArtifactMismatchError(QuantMLAError):
    """A saved transform artifact was made for another model, precision, quantizer or method."""


# in the artifacts folder: model-config hashes written by older code, which hashed the checkout's
# path with the config, each → today's `config_sha` (`python -m quantmla.migrate` verifies and
# writes them), so their artifacts load from any checkout without being rewritten
RETIRED_HASHES = "retired_config_hashes.json"


def retired_config_hashes(artifacts_dir: Path) -> dict[str, str]:
    """The artifacts folder's retired model-config hashes (old → current); empty if none."""
    file = Path(artifacts_dir) / RETIRED_HASHES
    return json.loads(file.read_text()) if file.is_file() else {}


def current_metadata(metadata: dict, retired: dict[str, str]) -> dict:
    """An artifact's metadata as today's code writes it: a retired config hash replaced."""
    old = metadata.get("model_config_hash")
    return {**metadata, "model_config_hash": retired[old]} if old in retired else metadata


def artifact_path(directory: Path, expected: dict[str, str], retired: dict[str, str]) -> Path:
    """Where the artifact for `expected` is: named by its metadata's hash, or by the hash its
    metadata had under a retired config hash if such a file exists."""
    current = Path(directory) / f"{stable_hash(expected, 16)}.safetensors"
    for old, new in sorted(retired.items()):
        legacy = current.with_name(
            f"{stable_hash({**expected, 'model_config_hash': old}, 16)}.safetensors"
        )
        if new == expected.get("model_config_hash") and legacy.is_file():
            return legacy
    return current


def read_metadata(path: str | Path, retired: dict[str, str]) -> dict[str, str]:
    """A saved artifact's metadata (its safetensors header alone), as `current_metadata`."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return current_metadata(f.metadata() or {}, retired)


@dataclass
class MethodJob:
    """What a method is given: the model's MLA modules, the quantizer spec, and for calibrated
    methods their calibration settings and the captured BF16 teacher."""

    modules: list[nn.Module]
    spec: QuantizerSpec | list[QuantizerSpec]  # one for every layer, or one per layer (mixed)
    calibration: CalibrationConfig | None = None
    context: CalibrationContext | None = None
    seed: int = 0
    log_dir: Path | None = None  # per-layer calibration curves (CSV) go here
    resume_path: Path | None = None  # a calibrated method's state while it runs (it resumes there)
    # (layer, path) → `reuse.Unit`: units an earlier artifact holds, taken as they are, not fitted
    fixed: dict = field(default_factory=dict)


@dataclass
class MethodResult:
    """A method's output for one model and precision: fused offline, plus an online post-RoPE
    Hadamard (QuaRot†'s; a calibrated method's with `rope_hadamard`)."""

    method: str
    layers: list[LayerTransforms]
    rope_online: str | None = None  # "hadamard": post-RoPE H_P on query and key, run online
    metadata: dict[str, str] = field(default_factory=dict)
    report: dict = field(default_factory=dict)  # calibration losses, chosen alphas, timings


@torch.no_grad()
def apply_method(model: nn.Module, adapter: MLAAdapter, result: MethodResult) -> None:
    """Fuse every layer's transforms into its weights; hand the online RoPE matrix, if any, to the
    layer's patch (the model must be patched)."""
    modules = adapter.attention_modules(model)
    if len(modules) != len(result.layers):
        raise ArtifactMismatchError(
            f"artifact has {len(result.layers)} layers, the model {len(modules)}"
        )
    for module, layer in zip(modules, result.layers):
        fuse_layer(module, adapter, layer, result.rope_online)


@torch.no_grad()
def fuse_layer(module: nn.Module, adapter: MLAAdapter, layer, rope_online: str | None) -> None:
    """One layer's part of `apply_method` (a mixed allocation's joint check fuses layer by layer)."""
    with dequantized_for_fusion(module):  # FP8 weights: dequantize → fuse → requantize
        if layer.content is not None:
            fuse_content(module, adapter, layer.content)
        if layer.rope is not None:
            fuse_rope(module, adapter, layer.rope)
    online = online_rope_matrix(rope_online, module.qk_rope_head_dim)
    if online is not None:
        layer_patch(module).rope_online = online.to(module.o_proj.weight)


def save_artifact(result: MethodResult, path: str | Path) -> None:
    tensors = {}
    for i, layer in enumerate(result.layers):
        if layer.content is not None:
            rotation = layer.content.rotation.detach().cpu()
            if not torch.equal(rotation, torch.eye(rotation.shape[-1], dtype=rotation.dtype)):
                # SmoothQuant†'s rotation is the identity: left out (d_c² float64 a layer)
                tensors[f"layers.{i}.content.rotation"] = rotation.contiguous()
            tensors[f"layers.{i}.content.scale"] = layer.content.scale.contiguous()
        if layer.rope is not None:
            tensors[f"layers.{i}.rope.angles"] = layer.rope.angles.contiguous()
            tensors[f"layers.{i}.rope.scales"] = layer.rope.scales.contiguous()
    metadata = {
        **result.metadata,
        "method": result.method,
        "n_layers": str(len(result.layers)),
        "rope_online": result.rope_online or "",
        "report": json.dumps(result.report, default=str),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_artifact(
    path: str | Path, expected: dict[str, str], retired: dict[str, str] | None = None
) -> MethodResult:
    """Load an artifact, stopping if any `expected` metadata field differs (a retired config hash
    read as its current one)."""
    metadata = read_metadata(path, retired or {})
    for key, value in expected.items():
        if metadata.get(key) != str(value):
            raise ArtifactMismatchError(
                f"artifact {path}: metadata {key}={metadata.get(key)!r} but this run needs {value!r}; "
                "delete it to recalibrate, or point method.artifact elsewhere"
            )
    tensors = load_file(str(path))
    layers = []
    for i in range(int(metadata["n_layers"])):
        content = rope = None
        if f"layers.{i}.content.scale" in tensors:
            scale = tensors[f"layers.{i}.content.scale"]
            identity = torch.eye(scale.shape[-1], dtype=scale.dtype)
            content = ContentTransform(tensors.get(f"layers.{i}.content.rotation", identity), scale)
        if f"layers.{i}.rope.angles" in tensors:
            rope = RopeTransform(
                tensors[f"layers.{i}.rope.angles"], tensors[f"layers.{i}.rope.scales"]
            )
        layers.append(LayerTransforms(content, rope))
    # what save_artifact adds; the rest (`method` too) is what it was saved with, so the artifact's
    # key (stable_hash of it) is the same whether it was loaded or fitted (an export's manifest)
    core = {"n_layers", "rope_online", "report"}
    return MethodResult(
        metadata["method"],
        layers,
        metadata["rope_online"] or None,
        {k: v for k, v in metadata.items() if k not in core},
        json.loads(metadata.get("report", "{}")),
    )
