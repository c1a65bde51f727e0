"""One layer's physical page pool: 64-token pages in the packed layout, a free list, the 8-byte
reverse page map per physical page, and per request a page table and a BF16 protection buffer
(first `sink` tokens + a ring of the last `recent`).

Byte offsets are int64 (1M tokens × batch 32 of C4R4 pages is 10 GiB per layer: past int32).
Errors are one line and leave the pool unchanged: a request beyond capacity names the pages it
needs and the pages free; releasing a request twice, or using a released one, raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantmla.errors import QuantMLAError
from quantmla.memory import PAGE_MAP_BYTES, CacheLayout

FREE = -1  # reverse-map entry of a page no request holds


class PoolExhaustedError(QuantMLAError, MemoryError):
    """A request needs more pages than the pool has free."""


class RequestStateError(QuantMLAError, KeyError):
    """A request id that is unknown, already released, or registered twice."""


@dataclass
class Request:
    """A request's view of the pool: its page table, token count and BF16 protection buffer."""

    request_id: int
    pages: list[int] = field(default_factory=list)  # logical page -> physical page
    tokens: int = 0
    protection: torch.Tensor | None = None  # (sink + recent, d_c + d_r) BF16

    def page_table(self, device=None) -> torch.Tensor:
        return torch.tensor(self.pages, dtype=torch.int64, device=device)


class PagePool:
    """Physical pages of one layer: `storage` (n_pages, page_bytes) uint8 and `reverse_map`
    (n_pages,) int64 = (request id << 32) | logical page, or FREE."""

    def __init__(
        self,
        layout: CacheLayout,
        n_pages: int,
        device: str | torch.device = "cpu",
        protection_dtype: torch.dtype = torch.bfloat16,
    ):
        if n_pages < 1:
            raise QuantMLAError(f"n_pages={n_pages} is not allowed; allowed: >= 1")
        layout.spec.check_dims(layout.d_c, layout.d_r)  # group size divides both paths
        self.layout, self.n_pages, self.device = layout, n_pages, torch.device(device)
        self.protection_dtype = protection_dtype  # BF16 (the layout's bytes); a float32 model: FP32
        self.storage = torch.zeros(n_pages, layout.page_bytes(), dtype=torch.uint8, device=device)
        self.reverse_map = torch.full((n_pages,), FREE, dtype=torch.int64, device=device)
        self.free: list[int] = list(range(n_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.requests: dict[int, Request] = {}

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: int) -> Request:
        if request_id in self.requests:
            raise RequestStateError(f"request {request_id} is already in the pool")
        protected = self.layout.sink + self.layout.recent if self.layout.quantized else 0
        buffer = torch.zeros(
            protected,
            self.layout.d_c + self.layout.d_r,
            dtype=self.protection_dtype,
            device=self.device,
        )
        request = Request(request_id, protection=buffer)
        self.requests[request_id] = request
        return request

    def request(self, request_id: int) -> Request:
        if request_id not in self.requests:
            raise RequestStateError(
                f"request {request_id} is not in the pool (never added, or released: use after free)"
            )
        return self.requests[request_id]

    def reserve(self, request_id: int, n_tokens: int) -> list[int]:
        """Grow the request's page table to hold `n_tokens` more tokens; all or nothing."""
        request = self.request(request_id)
        needed = math.ceil((request.tokens + n_tokens) / self.layout.page_tokens) - len(
            request.pages
        )
        if needed > len(self.free):
            raise PoolExhaustedError(
                f"request {request_id} needs {needed} more page(s) for {n_tokens} token(s); "
                f"{len(self.free)} of {self.n_pages} are free (nothing was allocated)"
            )
        new = [self.free.pop() for _ in range(max(needed, 0))]
        for offset, page in enumerate(new, start=len(request.pages)):
            self.reverse_map[page] = (request_id << 32) | offset
        request.pages.extend(new)
        request.tokens += n_tokens
        return new

    def grow(self, extra_pages: int) -> None:
        """Add `extra_pages` free pages (storage reallocated and copied; page numbers unchanged)."""
        old = self.n_pages
        storage = torch.zeros(
            old + extra_pages, self.storage.shape[1], dtype=torch.uint8, device=self.device
        )
        storage[:old] = self.storage
        reverse = torch.full((old + extra_pages,), FREE, dtype=torch.int64, device=self.device)
        reverse[:old] = self.reverse_map
        self.storage, self.reverse_map, self.n_pages = storage, reverse, old + extra_pages
        self.free = list(range(old + extra_pages - 1, old - 1, -1)) + self.free

    def release(self, request_id: int) -> None:
        """Return every page of the request to the free list (a second release raises)."""
        request = self.request(request_id)
        for page in request.pages:
            self.reverse_map[page] = FREE
            self.free.append(page)
        del self.requests[request_id]

    # -- addressing ------------------------------------------------------------------------------
    def slot(self, request_id: int, token: int) -> tuple[int, int]:
        """(physical page, token within the page) of a request's token."""
        request = self.request(request_id)
        if not 0 <= token < request.tokens:
            raise QuantMLAError(
                f"token {token} of request {request_id} is outside 0..{request.tokens - 1}"
            )
        page = self.layout.page_tokens
        return request.pages[token // page], token % page

    def byte_offset(self, page: int, section: str, within: int = 0) -> int:
        """int64 byte offset into the flat storage of `section` of physical `page`."""
        start, size = self.layout.sections()[section]
        if not 0 <= within < max(size, 1):
            raise QuantMLAError(f"offset {within} is outside section {section} ({size} B)")
        return int(page) * self.layout.page_bytes() + start + within

    # -- accounting ------------------------------------------------------------------------------
    def request_bytes(self, request_id: int) -> int:
        """Bytes the pool holds for one request, measured from tensor storage: its pages, their
        reverse-map entries and its protection buffer (the memory model's persistent bytes)."""
        request = self.request(request_id)
        page = self.storage[0].numel() * self.storage.element_size()
        map_entry = self.reverse_map.element_size()
        assert map_entry == PAGE_MAP_BYTES
        protection = request.protection.numel() * request.protection.element_size()
        per_page = page + (map_entry if self.layout.quantized else 0)
        return len(request.pages) * per_page + protection

    def pages_in_use(self) -> int:
        return self.n_pages - len(self.free)


def stacked_inputs(pool: PagePool, request_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page tables (B, max_pages) int64, lengths (B,) int32, protection (B, P, d_c + d_r))."""
    requests = [pool.request(r) for r in request_ids]
    width = max(1, max(len(r.pages) for r in requests))
    table = torch.zeros(len(requests), width, dtype=torch.int64)
    for i, r in enumerate(requests):
        table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int64)
    lens = torch.tensor([r.tokens for r in requests], dtype=torch.int32)
    prot = torch.stack([r.protection for r in requests])
    return table.to(pool.device), lens.to(pool.device), prot
