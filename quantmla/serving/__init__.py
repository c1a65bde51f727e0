"""Serving an export through vLLM: the packed MLA cache as an attention backend (`backend`,
registered by `plugin`), its settings and byte budget (`settings`), the per-request protection
rows (`protection`), the math on engine tensors (`paged_attention`), an engine builder, the server and the
throughput workload (`engine`, `serve`, `throughput`). Only `backend` and `plugin` import vLLM."""
