"""Lazy package exports: `python -m quantmla.run --help` and config errors import no torch."""

from __future__ import annotations

import importlib


def lazy_getattr(package: str, exports: dict[str, str]):
    """A module `__getattr__` that imports `exports[name]` (a module path) on first use."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
