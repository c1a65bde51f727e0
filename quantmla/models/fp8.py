"""FP8 block quantization in the DeepSeek-V3 checkpoint format: E4M3 weights with one float32
`weight_scale_inv` per 128 × 128 block (`w ≈ w_fp8 · scale_inv`, scale_inv = block amax / 448).

Used to write the project's tiny FP8 checkpoint (tests), to dequantize, and to re-quantize weights
after the offline fusion rewrote them (dequantize → fuse → requantize with the same blocks). One
E4M3 rounding of a normal value errs by at most 2⁻⁴ of it; a value below the smallest normal
(2⁻⁶ · scale_inv) by at most half the subnormal step, 2⁻¹⁰ · scale_inv.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

E4M3_MAX = 448.0
BLOCK = (128, 128)
FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
}


def _blocked(w: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """(R, C) → (R/br, br, C/bc, bc), zero-padded to whole blocks."""
    rows, cols = w.shape
    br, bc = block
    pr, pc = -rows % br, -cols % bc
    w = torch.nn.functional.pad(w, (0, pc, 0, pr))
    return w.reshape(w.shape[0] // br, br, w.shape[1] // bc, bc)


def quantize_blocks(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight of w's shape, float32 scale_inv (⌈R/br⌉, ⌈C/bc⌉)); NaN/Inf refused."""
    if not torch.isfinite(w).all():
        raise ValueError("FP8 block quantization: the weight has NaN/Inf")
    rows, cols = w.shape
    b = _blocked(w.float(), block)
    amax = b.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (b / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(b.shape[0] * block[0], b.shape[2] * block[1])[:rows, :cols].contiguous()
    return q, scale_inv


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """float32 w = q · scale_inv, each block by its own scale."""
    rows, cols = q.shape
    b = _blocked(q.float(), block) * scale_inv[:, None, :, None].float()
    return b.reshape(b.shape[0] * block[0], b.shape[2] * block[1])[:rows, :cols]


def fp8_eligible(name: str, shape) -> bool:
    """The weights an FP8 checkpoint stores as E4M3: projection matrices, not embeddings, lm_head,
    norms or the router (the same rule as the memory plan's)."""
    from quantmla.models.sizes import fp8_eligible

    return name.endswith(".weight") and fp8_eligible(name, tuple(shape))


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype=torch.bfloat16) -> Path:
    """Copy an FP8 block-quantized checkpoint as an ordinary `dtype` one, shard by shard (our own
    dequantization: transformers 5.24's on-load one requires every weight to be a whole number of
    blocks and stops on DeepSeek-V3's 576-row `kv_a_proj_with_mqa`, whose last block is partial)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(str(file))
            out = {}
            for name, t in tensors.items():
                if name.endswith("_scale_inv"):
                    continue
                scale = tensors.get(f"{name}_scale_inv")
                out[name] = (dequantize_blocks(t, scale) if scale is not None else t).to(dtype)
            save_file(out, str(dst / file.name), metadata={"format": "pt"})
        elif file.name == "config.json":
            config = json.loads(file.read_text())
            config.pop("quantization_config", None)
            (dst / file.name).write_text(json.dumps(config, indent=2) + "\n")
        elif file.is_file() and not file.name.endswith(".index.json"):
            shutil.copy2(file, dst / file.name)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {
            k: v for k, v in data["weight_map"].items() if not k.endswith("_scale_inv")
        }
        (dst / index.name).write_text(json.dumps(data, indent=2) + "\n")
    return dst


def _fp8_linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        m
        for m in module.modules()
        if hasattr(m, "weight_scale_inv")
        and getattr(m, "weight", None) is not None
        and m.weight.dtype == torch.float8_e4m3fn
    ]


@contextmanager
def dequantized_for_fusion(module: torch.nn.Module):
    """Inside: every FP8 linear of `module` holds its dequantized float32 weight (so the offline
    fusion edits ordinary weights); on exit each is re-quantized to E4M3 with fresh block scales."""
    linears = _fp8_linears(module)
    for m in linears:
        block = tuple(getattr(m, "block_size", None) or BLOCK)
        m.weight = torch.nn.Parameter(
            dequantize_blocks(m.weight.data, m.weight_scale_inv.data, block), requires_grad=False
        )
    try:
        yield linears
    finally:
        for m in linears:
            block = tuple(getattr(m, "block_size", None) or BLOCK)
            q, scale_inv = quantize_blocks(m.weight.data, block)
            m.weight = torch.nn.Parameter(q, requires_grad=False)
            m.weight_scale_inv.data = scale_inv.to(m.weight_scale_inv.dtype)
