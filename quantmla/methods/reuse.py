"""Units already fitted, taken from earlier artifacts instead of fitted again (docs/method.md §4).

A calibrated method's transforms are separable: each layer's content transform and its RoPE
transform (a *unit*) come from their own α search and their own objective with the other path
exact, and Adam moves each parameter on its own gradient. So a unit is a function of its path's
quantizer and of what every unit shares (model, weights, seed, calibration data, fit settings;
a setting of one path's, `PATH_SETTINGS`, only that path's units) alone: a C2R4 fit's content units are a C2R16 fit's, its RoPE units a C4R4 fit's, bit for bit
(tests/test_reuse.py). A run takes each unit an earlier artifact holds and fits only the others;
one whose units are all held fits nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantmla.errors import ConfigError
from quantmla.methods.base import MethodResult, load_artifact, read_metadata
from quantmla.spec import PATHS, QuantizerSpec
from quantmla.transforms import ContentTransform, LayerTransforms, RopeTransform

PER_RUN = ("precision", "quantizer")  # artifact metadata a unit does not depend on
# An artifact with a content path in a fixed-range format (`QuantizerSpec.fixed_range`) says that
# its content scales start at the latent's magnitude (`latent_magnitude`); earlier content units
# of such a format were fitted at u's (~1/Γ: an NVFP4 latent in E4M3's subnormals) and are not
# taken. Other formats dequantize alike at either magnitude: their units are taken from any fit.
MAGNITUDE = {"content_magnitude": "latent"}
# settings that shape one path's units only
PATH_SETTINGS = {"rope_objective": "rope", "rope_positions": "rope", "rope_hadamard": "rope"}


@dataclass(frozen=True)
class Unit:
    """One layer's transform of one path, as an earlier artifact holds it."""

    transform: ContentTransform | RopeTransform
    source: str  # the artifact's file name
    heldout: float | None = None  # its held-out objective at the step chosen (a fit's report)
    step: int | None = None


def needed_units(specs: list[QuantizerSpec]) -> dict[tuple[int, str], str]:
    """(layer, path) → path key of every quantized unit of a run (an unquantized one has none)."""
    return {
        (layer, path): key
        for layer, spec in enumerate(specs)
        for path in PATHS
        if (key := spec.path_key(path)) is not None
    }


def _artifact_specs(metadata: dict, n_layers: int) -> list[QuantizerSpec] | None:
    try:
        specs = [QuantizerSpec.from_key(k) for k in metadata["quantizer"].split(",")]
    except (KeyError, ConfigError):
        return None
    specs = specs * n_layers if len(specs) == 1 else specs
    return specs if len(specs) == n_layers else None


def _reported(report: dict, field: str, layer: int, path: str):
    entries = report.get(field) or []
    return entries[layer].get(path) if layer < len(entries) else None


def saved_units(
    directory: Path,
    expected: dict[str, str],
    specs: list[QuantizerSpec],
    retired: dict[str, str] | None = None,
) -> dict:
    """Every unit of this run that an artifact in `directory` holds under the same shared
    metadata (`expected` but its precision and quantizer, and the other path's own settings; a
    retired config hash read as its current one), the first file by name for each."""
    wanted, found = needed_units(specs), {}
    skipped = (*PER_RUN, "calibration", *MAGNITUDE)
    shared = {k: str(v) for k, v in expected.items() if k not in skipped}
    for file in sorted(Path(directory).glob("*.safetensors")):
        metadata = read_metadata(file, retired or {})
        if any(metadata.get(k) != v for k, v in shared.items()):
            continue
        theirs = _artifact_specs(metadata, len(specs))
        if theirs is None or "calibration" not in metadata:
            continue
        settled = {
            p: _path_settings(metadata["calibration"], p)
            == _path_settings(expected["calibration"], p)
            for p in PATHS
        }
        magnitude = all(metadata.get(k) == v for k, v in MAGNITUDE.items())
        held = [
            (layer, p)
            for (layer, p), key in wanted.items()
            if (layer, p) not in found
            and settled[p]
            and theirs[layer].path_key(p) == key
            and (magnitude or p != "content" or not specs[layer].fixed_range(p))
        ]
        if not held:
            continue
        result = load_artifact(file, shared, retired)
        for layer, path in held:
            transform = getattr(result.layers[layer], path)
            if transform is not None:
                found[(layer, path)] = Unit(
                    transform,
                    file.name,
                    _reported(result.report, "best_heldout", layer, path),
                    _reported(result.report, "best_step", layer, path),
                )
    return found


def _path_settings(calibration: str, path: str) -> dict:
    """An artifact's fit settings (its metadata's JSON) that shape `path`'s units."""
    return {k: v for k, v in json.loads(calibration).items() if PATH_SETTINGS.get(k, path) == path}


def reuse_report(units: dict) -> dict[str, list[str]]:
    """Artifact file → the units taken from it ('layer/path')."""
    report: dict[str, list[str]] = {}
    for (layer, path), unit in sorted(units.items()):
        report.setdefault(unit.source, []).append(f"{layer}/{path}")
    return report


def with_units(layers: list[LayerTransforms], units: dict) -> list[LayerTransforms]:
    """`layers` with every held unit in its place (a fit's result and the units it did not fit)."""
    return [
        LayerTransforms(
            *(units[(i, p)].transform if (i, p) in units else getattr(t, p) for p in PATHS)
        )
        for i, t in enumerate(layers)
    ]


def assemble(
    method: str, n_layers: int, units: dict, rope_online: str | None = None
) -> MethodResult:
    """A result made of held units only (a path without one is not quantized: no transform)."""
    layers = with_units([LayerTransforms() for _ in range(n_layers)], units)
    report = {
        "reused": reuse_report(units),
        **{
            field: [
                {p: getattr(units.get((layer, p)), attr, None) for p in PATHS}
                for layer in range(n_layers)
            ]
            for field, attr in (("best_step", "step"), ("best_heldout", "heldout"))
        },
    }
    return MethodResult(method, layers, rope_online, report=report)
