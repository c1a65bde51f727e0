"""QuantMLA: function-aligned dual-path quantization for low-bit MLA KV caching.

The public names are imported lazily, so `python -m quantmla.run --help` does not import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CachePolicy": "quantmla.policy",
    "QuantizerSpec": "quantmla.spec",
    "parse_precision": "quantmla.spec",
    "patch_model": "quantmla.simulator",
    "set_policy": "quantmla.simulator",
    "unpatch_model": "quantmla.simulator",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'quantmla' has no attribute {name!r}")
