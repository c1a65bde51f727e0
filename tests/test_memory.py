import pytest

from quantmla.memory import LAYOUTS, compression


def test_paper_page_and_buffer_sizes():
    assert LAYOUTS["c4r4"].token_bytes() == 320
    assert LAYOUTS["c4r4"].page_bytes() == 20_480
    assert LAYOUTS["bf16"].page_bytes() == 73_728
    assert LAYOUTS["c4r4"].protection_bytes() == 152_064 == 132 * 576 * 2


@pytest.mark.parametrize("tokens,ratio", [(4096, 3.2246), (131_072, 3.5856)])
def test_paper_compression_ratios(tokens, ratio):
    assert compression("c4r4", tokens) == pytest.approx(ratio, abs=5e-5)


def test_formulas():
    for tokens in (1, 63, 64, 65, 1000, 1 << 20):
        pages = -(-tokens // 64)
        assert LAYOUTS["bf16"].persistent_bytes(tokens) == pages * 73_728
        assert LAYOUTS["c4r4"].persistent_bytes(tokens) == pages * (20_480 + 8) + 152_064
    assert LAYOUTS["c2r4"].token_bytes() == 128 + 32 + 32
    assert LAYOUTS["c4r16"].token_bytes() == 256 + 128 + 24
