"""QuantMLA: function-aligned dual-path quantization for low-bit MLA KV caching."""

from quantmla.simulator import CachePolicy, parse_precision, patch_model, set_policy, unpatch_model

__all__ = ["CachePolicy", "parse_precision", "patch_model", "set_policy", "unpatch_model"]
