"""Data layer: raw text sources (local or hub) and the seeded sampling protocols built on them."""

from quantmla.data.protocols import (
    CalibrationSplit,
    calibration_split,
    perplexity_windows,
    sensitivity_cell,
    tokenize,
)
from quantmla.data.sources import DATA_DIR_ENV, load_documents, load_text, resolve_data_dir

__all__ = [
    "DATA_DIR_ENV",
    "CalibrationSplit",
    "calibration_split",
    "load_documents",
    "load_text",
    "perplexity_windows",
    "resolve_data_dir",
    "sensitivity_cell",
    "tokenize",
]
