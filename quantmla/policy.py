"""How a layer reads its latent cache: the quantizer spec, the BF16 protection window and the form."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from quantmla.errors import ConfigError, QuantMLAError
from quantmla.spec import KERNELS, SPEC_FIELDS, QuantizerSpec

FORMS = ("auto", "expanded", "absorbed")
MIXED = "mixed"  # one format per layer, chosen under a bytes budget (quantmla.allocation)
BACKENDS = ("simulator", "packed")


@dataclass(frozen=True)
class CachePolicy:
    """Precision, protection (first `sink` and last `recent` tokens read unquantized), attention form.

    Validated on construction; `spec` is the quantizer spec the cache's codes follow. A mixed
    policy (`precision='mixed'`) has one precision per MLA layer in `layer_precisions`, set by
    prepare once the allocator has chosen them; its layers each read their own spec."""

    precision: str = "bf16"  # 'bf16', 'c<x>r<y>' or 'mixed'
    sink: int = 4
    recent: int = 128
    group_size: int = 64
    form: str = "auto"  # auto | expanded | absorbed
    content_meta_dtype: str = "bfloat16"
    rope_meta_dtype: str = "float32"
    check_finite: bool = True
    incremental: bool = True  # quantize each token once as it enters a DynamicCache (same values)
    backend: str = "simulator"  # packed: generation through kernels/paged_cache (same function)
    kernel: str = "auto"  # packed backend: torch (CPU path), triton, or auto (Triton on CUDA)
    layer_precisions: tuple[str, ...] | None = None  # a mixed policy's allocation, one per layer

    def __post_init__(self):
        if self.mixed:
            for p in self.layer_precisions or ():
                self.layer(p).spec  # noqa: B018
        elif self.layer_precisions is not None:
            raise ConfigError(
                "layer_precisions", self.layer_precisions, "None unless precision=mixed"
            )
        else:
            self.spec  # noqa: B018  (validates precision, group size, metadata dtypes)
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, value, "an integer >= 0")
        if self.form not in FORMS:
            raise ConfigError("form", self.form, FORMS)
        if self.backend not in BACKENDS:
            raise ConfigError("cache.backend", self.backend, BACKENDS)
        if self.kernel not in KERNELS:
            raise ConfigError("cache.kernel", self.kernel, KERNELS)

    @classmethod
    def from_config(cls, cfg) -> CachePolicy:
        """The run's policy from its `precision` and `cache` config groups."""
        p, cache = cfg.precision, getattr(cfg, "cache", None)
        backend = {"backend": cache.backend, "kernel": cache.kernel} if cache is not None else {}
        return cls(p.name, p.sink, p.recent, p.group_size, **backend)

    @property
    def mixed(self) -> bool:
        return self.precision == MIXED

    def layer(self, precision: str) -> CachePolicy:
        """This policy with one format (a mixed policy's layer)."""
        return replace(self, precision=precision, layer_precisions=None)

    def precisions(self, n_layers: int) -> list[str]:
        """The precision of each of `n_layers` MLA layers."""
        if not self.mixed:
            return [self.precision] * n_layers
        if self.layer_precisions is None:
            raise QuantMLAError("precision=mixed: no allocation yet (prepare makes it)")
        if len(self.layer_precisions) != n_layers:
            raise ConfigError(
                "layer_precisions", len(self.layer_precisions), f"{n_layers}: one per MLA layer"
            )
        return list(self.layer_precisions)

    def specs(self, n_layers: int) -> list[QuantizerSpec]:
        return [self.layer(p).spec for p in self.precisions(n_layers)]

    @cached_property
    def spec(self) -> QuantizerSpec:
        """Built once per policy (the patched forward reads it on every call)."""
        if self.mixed:
            raise ConfigError(
                "precision", MIXED, "one format for every layer (this step reads a single spec)"
            )
        return QuantizerSpec.from_precision(
            self.precision, **{f: getattr(self, f) for f in SPEC_FIELDS}
        )

    def check_dims(self, d_c: int, d_r: int) -> None:
        for p in self.layer_precisions or (() if self.mixed else (self.precision,)):
            self.layer(p).spec.check_dims(d_c, d_r)
