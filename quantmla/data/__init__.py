"""Data layer: raw text sources (local or hub) and the seeded sampling protocols built on them.

Names are imported lazily so that validating a config (which only resolves folders) imports no torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CalibrationSplit": "protocols",
    "calibration_split": "protocols",
    "perplexity_windows": "protocols",
    "sensitivity_cell": "protocols",
    "tokenize": "protocols",
    "DATA_DIR_ENV": "sources",
    "load_documents": "sources",
    "load_text": "sources",
    "resolve_data_dir": "sources",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"quantmla.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'quantmla.data' has no attribute {name!r}")
