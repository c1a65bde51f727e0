"""Capture each MLA attention module's input hidden states from the BF16 teacher, once.

Everything calibration needs (the latent c, k_R, positional queries, the teacher's attention
output) is recomputed per layer from these inputs with the frozen module, so only the inputs are
stored: one (N, L, hidden) tensor per attention layer, in memory or as memory-mapped files on disk
(`store_dir`), filled batch by batch during ordinary full-model forwards (never the whole model's
activations at once).

Memory: N·L·hidden·bytes per layer. DeepSeek-V2-Lite, 128 calibration + 32 held-out sequences of
2048 tokens, bf16: 160·2048·2048·2 B = 1.25 GiB per layer, 27 layers = 33.8 GiB on disk
(`store_dir`); in (GPU) memory at once: one forward batch of activations plus, during
calibration, one batch of one layer's inputs (e.g. 4·2048·2048·2 B = 32 MiB) and its attention
working set. The tiny model (6 layers, hidden 256, 160 × 512 tokens, fp32): 84 MiB per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from quantmla.metrics import nmse


def map_position_embeddings(pe, fn):
    """Apply `fn` to RoPE position embeddings: one tensor (DeepSeek-V2's complex freqs) or (cos, sin)."""
    return fn(pe) if isinstance(pe, torch.Tensor) else tuple(fn(p) for p in pe)


class ActivationStore:
    """Per-layer (N, L, hidden) input tensors, in RAM or memory-mapped under `store_dir`."""

    def __init__(
        self,
        n_layers: int,
        n_sequences: int,
        seq_len: int,
        hidden: int,
        dtype: torch.dtype,
        store_dir: str | Path | None = None,
    ):
        shape = (n_sequences, seq_len, hidden)
        if store_dir is None:
            self.inputs = [torch.empty(shape, dtype=dtype) for _ in range(n_layers)]
        else:
            root = Path(store_dir)
            root.mkdir(parents=True, exist_ok=True)
            numel = n_sequences * seq_len * hidden
            self.inputs = [
                torch.from_file(
                    str(root / f"layer_{i:03d}.bin"), shared=True, size=numel, dtype=dtype
                ).view(shape)
                for i in range(n_layers)
            ]
        self.position_embeddings: list = [None] * n_layers


@torch.no_grad()
def capture_inputs(
    model: nn.Module,
    modules: list[nn.Module],
    sequences: torch.Tensor,
    batch_size: int = 4,
    store_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> ActivationStore:
    """Run the (unpatched, unquantized) model over `sequences` (N, L) and keep every MLA input."""
    device = next(model.parameters()).device
    hidden = model.config.hidden_size
    store = ActivationStore(
        len(modules),
        sequences.shape[0],
        sequences.shape[1],
        hidden,
        dtype or next(model.parameters()).dtype,
        store_dir,
    )
    cursor = {"start": 0}
    hooks = []
    for i, module in enumerate(modules):

        def hook(mod, args, kwargs, output, i=i):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            start = cursor["start"]
            store.inputs[i][start : start + h.shape[0]] = h.to(store.inputs[i].dtype).cpu()
            if store.position_embeddings[i] is None:
                store.position_embeddings[i] = map_position_embeddings(
                    kwargs.get("position_embeddings"), lambda p: p[:1].cpu()
                )

        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        for start in tqdm(range(0, sequences.shape[0], batch_size), desc="capture", leave=False):
            cursor["start"] = start
            model(sequences[start : start + batch_size].to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return store


@dataclass
class OutputNMSE:
    """Per-layer attention-output NMSE of a quantized cache: every layer fed the *teacher's*
    inputs, so each number isolates that layer's cache error (post-o_proj, protection on)."""

    store: ActivationStore
    teacher: list[torch.Tensor]

    @staticmethod
    def _outputs(modules, store: ActivationStore) -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for i, module in enumerate(modules):
                device = module.o_proj.weight.device
                pe = map_position_embeddings(
                    store.position_embeddings[i], lambda p, d=device: p.to(d)
                )
                h = store.inputs[i].to(device)
                outs.append(
                    module(hidden_states=h, position_embeddings=pe, attention_mask=None)[0]
                    .float()
                    .cpu()
                )
        return outs

    @classmethod
    def capture(cls, model, modules, sequences: torch.Tensor, batch_size: int = 4) -> OutputNMSE:
        """Teacher inputs and outputs, with the model as it is now (call with quantization off)."""
        store = capture_inputs(model, modules, sequences, batch_size)
        return cls(store, cls._outputs(modules, store))

    def measure(self, modules) -> list[float]:
        outputs = self._outputs(modules, self.store)
        return [float(nmse(o, t)) for o, t in zip(outputs, self.teacher)]
