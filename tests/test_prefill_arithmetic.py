"""The prefill's arithmetic count (benchmarks/serve_prefill.py): under the rule every query reads
each earlier key exactly once — dequantized or exact — so C4R4's pairs read equal BF16 mode's
causal n(n + 1)/2, whatever the chunking; what C4R4 adds is expanded rows and the band's unread
pairs."""

import pytest
import torch

from benchmarks import serve_prefill as bench


@pytest.mark.parametrize("prompt,chunk", [(700, 256), (700, 2048), (300, 64)])
def test_both_modes_read_each_key_once(prompt, chunk):
    gen = torch.Generator().manual_seed(0)
    proj = torch.nn.Linear(bench.D_C, bench.HEADS * (bench.D_NOPE + bench.D_V), bias=False)
    inputs = (
        torch.randn(prompt, bench.HEADS, bench.D_NOPE + bench.D_R, generator=gen),
        torch.randn(prompt, bench.D_C, generator=gen),
        torch.randn(prompt, bench.D_R, generator=gen),
        proj,
    )
    with torch.no_grad():
        bf16 = bench.arithmetic("bf16", inputs, prompt, chunk)
        c4r4 = bench.arithmetic("c4r4", inputs, prompt, chunk)
    causal = prompt * (prompt + 1) // 2
    assert bf16["fused_pairs"] == causal and bf16["window_pairs"] == 0
    assert c4r4["fused_pairs"] + c4r4["window_pairs_read"] == causal
    assert c4r4["window_pairs"] >= c4r4["window_pairs_read"]
    # BF16 mode expands each chunk and its whole context once per chunk
    starts = range(0, prompt, chunk)
    assert bf16["expanded_rows"] == sum(min(prompt, s + chunk) for s in starts)
    assert c4r4["expanded_rows"] > bf16["expanded_rows"]
