"""Per-request BF16 protection rows inside an engine that tells its attention backend no request ids.

An engine hands the backend block tables, sequence lengths and slot mappings. Without prefix
caching a live request's first physical block is its own, so it keys the request's protection
slot: a row with no cached tokens yet takes a slot (the one its first block held before, else a
free one, else the least recently seen slot of a request absent from this batch), a continuing
row must find its slot holding exactly its cached token count — otherwise the rows were lost
and the step stops with that reason instead of reading another request's rows. Every token is
also packed, so a token leaving the window needs no rewrite (as `kernels/paged_cache/pool.py`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from quantmla.errors import QuantMLAError
from quantmla_kernels.paged_cache.layout import held_positions, kept_in_protection, protection_slots


class ProtectionLostError(QuantMLAError, RuntimeError):
    """A continuing request has no protection slot with its rows (more live requests than slots)."""


class ProtectionTable:
    """`buffer` (n_slots, sink + recent, width) of one layer, and which request holds each slot."""

    def __init__(self, n_slots: int, sink: int, recent: int, width: int, dtype, device):
        self.sink, self.recent = sink, recent
        self.buffer = torch.zeros(n_slots, sink + recent, width, dtype=dtype, device=device)
        self.owner: dict[int, int] = {}  # first physical block -> slot
        self.tokens = [0] * n_slots  # cached tokens the slot's rows belong to
        self.seen = [-1] * n_slots  # step at which the slot was last used
        self.step = 0

    @property
    def n_slots(self) -> int:
        return self.buffer.shape[0]

    def _take(self, block: int, batch_blocks: set[int]) -> int:
        held = self.owner.get(block)
        if held is not None:  # its first block was freed and handed out again
            return held
        owned = dict((slot, b) for b, slot in self.owner.items())
        free = [s for s in range(self.n_slots) if s not in owned]
        if not free:
            free = sorted(
                (s for s, b in owned.items() if b not in batch_blocks), key=lambda s: self.seen[s]
            )
        if not free:
            raise ProtectionLostError(
                f"{self.n_slots} protection slots are all held by requests of this batch; "
                "max_num_seqs must not exceed the slots the backend allocated"
            )
        slot = free[0]
        self.owner.pop(owned.get(slot), None)
        self.owner[block] = slot
        return slot

    def assign(
        self, first_blocks: list[int], cached: list[int], batch_blocks: set[int] | None = None
    ) -> torch.Tensor:
        """Slot per row (`cached` = tokens already in the cache before this step); `batch_blocks`:
        the first blocks of the whole step's batch, whose slots are never taken."""
        self.step += 1
        batch = set(first_blocks) | (batch_blocks or set())
        slots = []
        for block, before in zip(first_blocks, cached):
            if before == 0:
                slot = self._take(block, batch)
                self.tokens[slot] = 0
            else:
                slot = self.owner.get(block)
                if slot is None or self.tokens[slot] != before:
                    raise ProtectionLostError(
                        f"the request whose first block is {block} has {before} cached tokens, "
                        f"but its protection slot holds "
                        f"{'none' if slot is None else self.tokens[slot]}"
                    )
            self.seen[slot] = self.step
            slots.append(slot)
        return torch.tensor(slots, dtype=torch.int64)

    def write(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start.. start + n of one request (the sinks and its last `recent`)."""
        keep, where = _write_plan(start, rows.shape[0], self.sink, self.recent)
        self.buffer[slot, where.to(self.buffer.device)] = rows[keep.to(rows.device)].to(
            self.buffer.dtype
        )
        self.tokens[slot] = start + rows.shape[0]

    def write_next(self, slots: torch.Tensor, positions: list[int], rows: torch.Tensor) -> None:
        """One new token per request (decode): row b at position `positions[b]` of slot b."""
        pos = torch.tensor(positions)
        keep = kept_in_protection(pos, pos + 1, self.sink, self.recent).nonzero().flatten()
        if keep.numel():
            device = self.buffer.device
            where = protection_slots(pos[keep], self.sink, self.recent).to(device)
            self.buffer[slots[keep].to(device), where] = rows[keep.to(rows.device)].to(
                self.buffer.dtype
            )
        for slot, p in zip(slots.tolist(), positions):
            self.tokens[slot] = p + 1

    def held(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, rows) the slot holds for its cached tokens, in position order: the sinks
        and the last `recent` (a chunked prefill's context rows; copies, safe to overwrite)."""
        pos, where = _held_plan(self.tokens[slot], self.sink, self.recent)
        return pos, self.buffer[slot, where.to(self.buffer.device)]


# Index plans per (positions, sink, recent): every layer of an engine asks for the same ones in a
# step, so they are built once (bounded: chunk boundaries and lengths repeat across requests).
@lru_cache(maxsize=4096)
def _write_plan(start: int, n: int, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(which of n new rows at start.. a buffer keeps, the buffer rows they go to)."""
    pos = torch.arange(start, start + n)
    keep = kept_in_protection(pos, start + n, sink, recent)
    return keep.nonzero().flatten(), protection_slots(pos[keep], sink, recent)


@lru_cache(maxsize=4096)
def _held_plan(tokens: int, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions a `tokens`-long request's buffer holds in position order, their buffer rows)."""
    pos = held_positions(tokens, sink, recent)
    return pos, protection_slots(pos, sink, recent)
