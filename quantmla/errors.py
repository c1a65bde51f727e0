"""Errors that name the offending field, its value and what is allowed, in one line."""

from __future__ import annotations

from collections.abc import Iterable


class QuantMLAError(Exception):
    """Base class of the project's user-facing errors."""


class ConfigError(QuantMLAError, ValueError):
    """A configuration value is not allowed."""

    def __init__(self, field: str, value: object, allowed: Iterable[object] | str):
        allowed_text = allowed if isinstance(allowed, str) else ", ".join(map(str, allowed))
        super().__init__(f"{field}={value!r} is not allowed; allowed: {allowed_text}")
        self.field, self.value = field, value


class DataNotFoundError(QuantMLAError, FileNotFoundError):
    """A dataset or checkpoint path does not exist; the message says where we looked."""


class NonFiniteCacheError(QuantMLAError, FloatingPointError):
    """A cached MLA vector holds NaN/Inf; stopped before it can reach other tokens' attention."""


class NotImplementedYet(QuantMLAError, NotImplementedError):
    """The config exists (so sweeps compose) but its computation arrives in later work."""


class CheckpointError(QuantMLAError):
    """A checkpoint file is present but unusable (truncated, corrupt); the message names it."""
