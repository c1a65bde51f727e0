"""The one seam every Triton launch of the project goes through. `launch(kernel, grid, ...)` runs
`kernel[grid](...)`; inside `recording()` it records the call instead, and `compiles_for_gpu`
answers as a CUDA launch would, so running the launchers on small CPU tensors yields exactly the
specialisations a GPU run compiles (`aot.py` compiles them for sm_80 / sm_90 without a GPU)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

_RECORDED: list | None = None


@dataclass
class Launch:
    kernel: object  # the @triton.jit function (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple
    args: tuple
    kwargs: dict


@contextmanager
def recording():
    """Launches inside are recorded (a list of `Launch`), not run."""
    global _RECORDED
    previous, _RECORDED = _RECORDED, []
    try:
        yield _RECORDED
    finally:
        _RECORDED = previous


def compiles_for_gpu(tensor: torch.Tensor) -> bool:
    """Whether a launch on `tensor` is compiled for a GPU: a CUDA tensor, or any while recording
    (the launchers choose dot dtypes and operand casts by this, not by the device alone)."""
    return tensor.device.type == "cuda" or _RECORDED is not None


def launch(kernel, grid, *args, **kwargs):
    if _RECORDED is not None:
        _RECORDED.append(Launch(kernel, tuple(grid), args, kwargs))
        return None
    return kernel[grid](*args, **kwargs)
