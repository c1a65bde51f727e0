"""Quantize each token once, when it enters the cache (generation through the simulated cache).

Quantization is per token, so the dequantized history is the concatenation of each token's own
dequantized copy: re-quantizing the whole history every decode step (what the simulator did)
computes exactly the same values at O(T) cost per step. `DequantizedLatentLayer` is transformers'
`DynamicLayer` plus that copy: raw `c`/`k_R` stay in `keys`/`values` (the protected tokens read
them), `keys_hat`/`values_hat` hold the dequantized ones, and every cache operation (crop, beam
reorder, batch repeat/select, reset) applies to both. The patched forward upgrades a plain
`DynamicLayer` in place on first use (only attributes are added), so `model.generate` needs no
special cache; any other layer type falls back to re-quantizing the history.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from quantmla.quant import qdq_content, qdq_rope
from quantmla.spec import QuantizerSpec


class DequantizedLatentLayer(DynamicLayer):
    keys_hat: torch.Tensor | None = None
    values_hat: torch.Tensor | None = None
    hat_spec: QuantizerSpec | None = None

    def dequantized(
        self, new_keys: torch.Tensor, new_values: torch.Tensor, spec: QuantizerSpec
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized history after `update` appended `new_*`: only the new tokens are
        quantized; rebuilt from the raw history if the spec changed or the copy is out of step."""
        total, n = self.keys.shape[-2], new_keys.shape[-2]
        in_step = (
            self.hat_spec == spec
            and self.keys_hat is not None
            and self.keys_hat.shape[-2] + n == total
        )
        if in_step:
            self.keys_hat = torch.cat([self.keys_hat, qdq_content(spec, new_keys)], dim=-2)
            self.values_hat = torch.cat([self.values_hat, qdq_rope(spec, new_values)], dim=-2)
        else:
            self.keys_hat, self.values_hat = (
                qdq_content(spec, self.keys),
                qdq_rope(spec, self.values),
            )
        self.hat_spec = spec
        return self.keys_hat, self.values_hat

    def _both(self, fn) -> None:
        if self.keys_hat is not None:
            self.keys_hat, self.values_hat = fn(self.keys_hat), fn(self.values_hat)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self._both(lambda t: t[..., :tokens_to_remove, :])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._both(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._both(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._both(lambda t: t[indices, ...])

    def reset(self) -> None:
        super().reset()
        self.keys_hat = self.values_hat = self.hat_spec = None


def dequantized_layer(cache, layer_idx: int) -> DequantizedLatentLayer | None:
    """The cache's layer as a `DequantizedLatentLayer` (a plain DynamicLayer is upgraded in place),
    or None for layer types that cannot keep the copy (then the history is re-quantized)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is DynamicLayer:
        layer.__class__ = DequantizedLatentLayer
    return layer if isinstance(layer, DequantizedLatentLayer) else None
