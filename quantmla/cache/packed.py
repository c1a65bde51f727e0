"""Generation through the paged packed cache (`cache.backend=packed`).

`PackedLatentLayer` is a transformers cache layer whose tokens live in one `PagePool` per layer
(one request per batch row): nothing is kept in BF16 but the protection buffers. The patched MLA
forward (`quantmla.simulator`) hands a layer to `packed_attention` when the policy says
`backend=packed`: a plain `DynamicLayer` is upgraded in place on first use, so `model.generate`
(and lm-eval's HFLM) need no special cache object.

Prefill (empty cache) attends with the simulator's math over the prompt's own rows, which equals
reading them back from the pool (the reader's values are the quantizer's); then the writer packs
them. Each decode step packs the new token and runs the cache's decode op (`ops.decode_pool`: the
Triton kernel on CUDA, the CPU path elsewhere) over the pages and the BF16 protection rows. Left-padded batches,
chunked prefill and beam search are not supported (one line each)."""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import DynamicLayer

from quantmla.attention import attention_output, cache_regions
from quantmla.errors import ConfigError
from quantmla.memory import CacheLayout
from quantmla_kernels.paged_cache import ops
from quantmla_kernels.paged_cache.layout import check_packable
from quantmla_kernels.paged_cache.pool import PagePool


class PackedLatentLayer(DynamicLayer):
    pool: PagePool | None = None
    tokens: int = 0
    batch: int = 0
    kernel: str = "torch"

    def setup(self, layout: CacheLayout, batch: int, first_tokens: int, device, kernel: str, dtype):
        check_packable(layout)
        pages = batch * (math.ceil(first_tokens / layout.page_tokens) + 1)
        self.pool = PagePool(layout, pages, device=device, protection_dtype=dtype)
        for request in range(batch):
            self.pool.add_request(request)
        self.batch, self.tokens, self.kernel = batch, 0, kernel
        self.device, self.is_initialized = torch.device(device), True

    def append(self, c: torch.Tensor, k_r: torch.Tensor) -> None:
        """Pack (B, n, d_c) / (B, n, d_r) into each request's pages (the pool grows as needed)."""
        n = c.shape[1]
        page = self.pool.layout.page_tokens
        needed = self.batch * math.ceil((self.tokens + n) / page) - self.pool.pages_in_use()
        if needed > len(self.pool.free):
            self.pool.grow(max(needed - len(self.pool.free), self.pool.n_pages))
        for request in range(self.batch):
            ops.write_tokens(self.pool, request, c[request], k_r[request], kernel=self.kernel)
        self.tokens += n

    def attend(self, q_lat: torch.Tensor, q_rope: torch.Tensor, scaling: float) -> torch.Tensor:
        """(B, H, d_c) softmax-weighted latent of the last token's queries over the whole cache."""
        ids = list(range(self.batch))
        out, _ = ops.decode_pool(self.pool, ids, q_lat, q_rope, scaling, kernel=self.kernel)
        return out.float()

    def bytes_held(self) -> int:
        """Bytes the pool holds for this layer's requests, measured from tensor storage."""
        return sum(self.pool.request_bytes(r) for r in range(self.batch)) if self.pool else 0

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def _unsupported(self, *args, **kwargs):
        raise ConfigError(
            "cache.backend",
            "packed",
            "greedy/sampled generation without beam search or cache cropping",
        )

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported

    def reset(self) -> None:
        self.pool, self.tokens, self.batch, self.is_initialized = None, 0, 0, False


def packed_layer(cache, layer_idx: int) -> PackedLatentLayer:
    """The cache's layer as a `PackedLatentLayer` (an empty `DynamicLayer` is upgraded in place)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        raise ConfigError(
            "cache.backend", "packed", "a transformers Cache with one layer per model layer"
        )
    layer = layers[layer_idx]
    if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
        layer.__class__ = PackedLatentLayer
        layer.pool, layer.tokens, layer.batch = None, 0, 0
    if not isinstance(layer, PackedLatentLayer):
        raise ConfigError(
            "cache.backend",
            "packed",
            f"an empty DynamicLayer to pack into (got {type(layer).__name__})",
        )
    return layer


def packed_attention(module, patch, proj, cache, allowed, layout: CacheLayout):
    """Post-`o_proj` output of a patched MLA module whose cache is packed."""
    policy, adapter, geometry = patch.policy, patch.adapter, patch.geometry
    layer = packed_layer(cache, module.layer_idx)
    c, k_rot = proj.c, proj.k_rot
    b, n = c.shape[:2]
    if not bool(allowed[..., -1, :].all()):  # the last query sees every key unless keys are padding
        raise ConfigError(
            "cache.backend", "packed", "unpadded batches (left padding is not supported)"
        )
    if layer.tokens == 0:  # prefill: the simulator's math on the prompt's own rows, then pack them
        layer.setup(layout, b, n, c.device, ops.resolve(policy.kernel, c.device), c.dtype)
        q_slots = torch.arange(n, device=c.device)
        regions = cache_regions(policy, c, k_rot, allowed, q_slots)
        out = attention_output(
            module, adapter, proj.q_nope, proj.q_rot, regions, policy.form, geometry
        )
        layer.append(c, k_rot)
        return out
    if n != 1:
        raise ConfigError(
            "cache.backend", "packed", "prefill into an empty cache, then one token per step"
        )
    layer.append(c, k_rot)
    w_uk, w_uv = adapter.up_projections(module)
    q_lat = torch.einsum("bhd,hdc->bhc", proj.q_nope[:, :, 0].float(), w_uk.float())
    latent = layer.attend(q_lat, proj.q_rot[:, :, 0].float(), geometry.scaling)
    out = torch.einsum("bhc,hvc->bhv", latent, w_uv.float()).to(proj.q_nope.dtype)
    return module.o_proj(out.reshape(b, 1, -1).to(module.o_proj.weight.dtype))


def packed_bytes(cache) -> int:
    return sum(layer.bytes_held() for layer in cache.layers if isinstance(layer, PackedLatentLayer))
