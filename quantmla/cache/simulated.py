"""Quantize each token once, when it enters the cache (generation through the simulated cache).

Quantization is per token, so the dequantized history is the concatenation of each token's own
dequantized copy: re-quantizing the whole history every decode step (what the simulator did)
computes exactly the same values at O(T) cost per step. `DequantizedLatentLayer` is transformers'
`DynamicLayer` plus that copy: raw `c`/`k_R` stay in `keys`/`values` (the protected tokens read
them), `keys_hat`/`values_hat` hold the dequantized ones, all four appended in place (`appended`:
a step copies its own tokens, not the history), and every cache operation (crop, beam
reorder, batch repeat/select, reset) applies to both. The patched forward upgrades a plain
`DynamicLayer` in place on first use (only attributes are added), so `model.generate` needs no
special cache; any other layer type falls back to re-quantizing the history.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from quantmla.quant import qdq_content, qdq_rope
from quantmla.spec import QuantizerSpec


def appended(history: torch.Tensor | None, room: torch.Tensor | None, new: torch.Tensor):
    """(history + new along the token axis −2, the room holding it): `new` is written into the
    spare rows of `room` when `history` is its prefix, else into a new room with half as many rows
    again to spare — a decode step copies its own tokens, not the whole history (as `torch.cat`)."""
    n = history.shape[-2] if history is not None and history.numel() else 0
    end = n + new.shape[-2]
    fits = (
        n
        and room is not None
        and history.data_ptr() == room.data_ptr()
        and history.stride() == room.stride()
        and history.shape[:-2] == new.shape[:-2] == room.shape[:-2]
        and room.dtype == new.dtype
        and room.shape[-2] >= end
    )
    if not fits:
        room = new.new_empty((*new.shape[:-2], end + end // 2 + 16, new.shape[-1]))
        if n:
            room[..., :n, :] = history
    room[..., n:end, :] = new
    return room[..., :end, :], room


class DequantizedLatentLayer(DynamicLayer):
    keys_hat: torch.Tensor | None = None
    values_hat: torch.Tensor | None = None
    hat_spec: QuantizerSpec | None = None
    rooms: dict | None = None  # name -> the tensor whose prefix that attribute is (`appended`)

    def _append(self, name: str, new: torch.Tensor) -> None:
        self.rooms = self.rooms or {}
        value, self.rooms[name] = appended(getattr(self, name), self.rooms.get(name), new)
        setattr(self, name, value)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """DynamicLayer's update, appending in place (`appended`) instead of concatenating."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("keys", key_states)
        self._append("values", value_states)
        return self.keys, self.values

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
            self._append("keys_hat", qdq_content(spec, new_keys))
            self._append("values_hat", qdq_rope(spec, new_values))
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
        self.keys_hat = self.values_hat = self.hat_spec = self.rooms = None


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
