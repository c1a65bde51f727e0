"""How a layer reads its latent cache: the quantizer spec, the BF16 protection window and the form."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from quantmla.errors import ConfigError
from quantmla.spec import SPEC_FIELDS, QuantizerSpec

FORMS = ("auto", "expanded", "absorbed")
BACKENDS = ("simulator", "packed")
KERNELS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CachePolicy:
    """Precision, protection (first `sink` and last `recent` tokens read unquantized), attention form.

    Validated on construction; `spec` is the quantizer spec the cache's codes follow."""

    precision: str = "bf16"  # 'bf16' or 'c<x>r<y>'
    sink: int = 4
    recent: int = 128
    group_size: int = 64
    form: str = "auto"  # auto | expanded | absorbed
    content_meta_dtype: str = "bfloat16"
    rope_meta_dtype: str = "float32"
    check_finite: bool = True
    incremental: bool = True  # quantize each token once as it enters a DynamicCache (same values)
    backend: str = "simulator"  # packed: generation through kernels/paged_cache (same function)
    kernel: str = "auto"  # packed backend: torch reference, triton, or auto (triton where it runs)

    def __post_init__(self):
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

    @cached_property
    def spec(self) -> QuantizerSpec:
        """Built once per policy (the patched forward reads it on every call)."""
        return QuantizerSpec.from_precision(
            self.precision, **{f: getattr(self, f) for f in SPEC_FIELDS}
        )

    def check_dims(self, d_c: int, d_r: int) -> None:
        self.spec.check_dims(d_c, d_r)
