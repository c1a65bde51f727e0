"""Data layer: raw text sources (local or hub) and the seeded sampling protocols built on them."""

from quantmla._lazy import lazy_getattr

_PROTOCOLS, _SOURCES = "quantmla.data.protocols", "quantmla.data.sources"
_EXPORTS = {
    **dict.fromkeys(
        (
            "CalibrationSplit",
            "calibration_split",
            "document_stream",
            "perplexity_windows",
            "sensitivity_cell",
            "tokenize",
        ),
        _PROTOCOLS,
    ),
    **dict.fromkeys(("DATA_DIR_ENV", "load_documents", "load_text", "resolve_data_dir"), _SOURCES),
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
