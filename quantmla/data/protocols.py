"""Seeded sampling protocols over a token stream: perplexity windows, calibration sets, sensitivity cells.

All protocols cut a 1-D token stream into non-overlapping slots of `seqlen` tokens (the tail that
does not fill a slot is dropped), so any two windows taken from different slots are disjoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.errors import ConfigError


def tokenize(text: str, tokenizer) -> torch.Tensor:
    """The whole text as one 1-D LongTensor of token ids (no special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def document_stream(documents: list[str], tokenizer) -> list[int]:
    """Token ids of the documents in order, each followed by EOS (training streams, haystacks)."""
    ids: list[int] = []
    for enc in tokenizer(documents, add_special_tokens=False)["input_ids"]:
        ids += enc + [tokenizer.eos_token_id]
    return ids


def _slots(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    if seqlen < 2:
        raise ConfigError("seqlen", seqlen, "an integer >= 2")
    n = ids.numel() // seqlen
    return ids[: n * seqlen].view(n, seqlen)


def perplexity_windows(
    ids: torch.Tensor, seqlen: int, max_windows: int | None = None
) -> torch.Tensor:
    """GPTQ-style evaluation: consecutive non-overlapping windows from the start, (N, seqlen)."""
    windows = _slots(ids, seqlen)
    return windows if max_windows is None else windows[:max_windows]


@dataclass(frozen=True)
class CalibrationSplit:
    calibration: torch.Tensor  # (n_calib, seqlen)
    heldout: torch.Tensor  # (n_heldout, seqlen)
    calibration_slots: torch.Tensor  # slot indices, for auditing disjointness
    heldout_slots: torch.Tensor


def calibration_split(
    ids: torch.Tensor, n_calib: int, n_heldout: int, seqlen: int, seed: int
) -> CalibrationSplit:
    """`n_calib` calibration and `n_heldout` held-out windows from distinct random slots (disjoint)."""
    windows = _slots(ids, seqlen)
    needed = n_calib + n_heldout
    if needed > windows.shape[0]:
        raise ConfigError(
            "calibration n_calib+n_heldout",
            needed,
            f"at most {windows.shape[0]} windows of {seqlen} tokens fit this split; lower the counts or seqlen",
        )
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))
    cal, held = order[:n_calib], order[n_calib:needed]
    return CalibrationSplit(windows[cal], windows[held], cal, held)


def sensitivity_cell(
    ids: torch.Tensor, seed: int, n_sequences: int = 8, seqlen: int = 512
) -> torch.Tensor:
    """One (dataset, seed) cell of the sensitivity study: `n_sequences` non-overlapping windows."""
    return calibration_split(ids, n_sequences, 0, seqlen, seed).calibration
