"""vLLM general plugin (entry point `vllm.general_plugins: quantmla`): registers the packed-cache
MLA backend. On CPU vLLM picks only its own MLA backends, so the plug-in takes their place; on
CUDA it is the `CUSTOM` backend (`attention_backend="CUSTOM"`). Loaded in every vLLM process, so
registering twice is harmless."""

from __future__ import annotations

BACKEND = "quantmla.serving.backend.QuantMLABackend"


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        for name in ("CPU_MLA", "AMX_MLA"):
            if hasattr(AttentionBackendEnum, name):
                register_backend(getattr(AttentionBackendEnum, name), BACKEND)
    else:
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND)


def platform() -> str | None:
    """Entry point `vllm.platform_plugins: quantmla`: vLLM's CPU or CUDA platform with the QuantMLA
    backend's scheduler settings and start-up checks (quantmla/serving/platform.py); None where
    neither built-in platform applies."""
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin

    if cuda_platform_plugin() is not None:
        return "quantmla.serving.platform.QuantMLACudaPlatform"
    if cpu_platform_plugin() is not None:
        return "quantmla.serving.platform.QuantMLACpuPlatform"
    return None
