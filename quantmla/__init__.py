"""QuantMLA: function-aligned dual-path quantization for low-bit MLA KV caching."""

from quantmla._lazy import lazy_getattr

_EXPORTS = {
    "CachePolicy": "quantmla.policy",
    "QuantizerSpec": "quantmla.spec",
    "parse_precision": "quantmla.spec",
    "patch_model": "quantmla.simulator",
    "set_policy": "quantmla.simulator",
    "unpatch_model": "quantmla.simulator",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
