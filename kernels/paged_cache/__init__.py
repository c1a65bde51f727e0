"""The paged, packed MLA latent cache: physical page pools, page tables, BF16 protection buffers.

The byte layout is `quantmla.memory.CacheLayout` — the same object the memory model (Fig. 5a)
reads — so the bytes a pool holds are the bytes the memory model reports (tested)."""
