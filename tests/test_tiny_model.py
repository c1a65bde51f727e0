"""The committed tiny MLA testbed: loads offline, is a real language model, and its data stays disjoint."""

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantmla.data import calibration_split, load_text, perplexity_windows, tokenize
from quantmla.evaluation.perplexity import perplexity
from tests.conftest import TINY_MLA

# WikiText-2 test perplexity of the first 8 windows of 512 tokens (see docs/testbeds.md).
PPL_BOUND = (
    340.0  # measured 306.1 (first 8 windows of 512); unigram perplexity of the same text: 719.7
)

pytestmark = pytest.mark.skipif(
    not (TINY_MLA / "config.json").is_file(), reason="assets/tiny-mla not built"
)


@pytest.fixture(scope="module")
def tiny():
    model = AutoModelForCausalLM.from_pretrained(TINY_MLA, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TINY_MLA)


@pytest.fixture(scope="module")
def test_ids(tiny, data_dir_module):
    return tokenize(load_text("wikitext2", "test", data_dir_module), tiny[1])


@pytest.fixture(scope="module")
def data_dir_module():
    from tests.conftest import DATA_DIR

    if not DATA_DIR.is_dir():
        pytest.skip("shared data not found")
    return DATA_DIR


def test_architecture(tiny):
    config = tiny[0].config
    assert config.model_type == "deepseek_v3" and config.qk_rope_head_dim == 64
    assert config.kv_lora_rank % 64 == 0 and config.kv_lora_rank >= 128
    assert config.num_hidden_layers >= 6 and config.num_attention_heads >= 4
    assert sum(p.stat().st_size for p in TINY_MLA.glob("*.safetensors")) <= 25 * 2**20


def test_wikitext_perplexity_is_low(tiny, test_ids):
    model, _ = tiny
    ppl = perplexity(model, perplexity_windows(test_ids, 512, max_windows=8), batch_size=4)
    counts = Counter(test_ids.tolist())
    total = sum(counts.values())
    unigram_ppl = math.exp(-sum(c / total * math.log(c / total) for c in counts.values()))
    assert ppl < PPL_BOUND
    assert ppl < unigram_ppl / 2


def test_calibration_windows_never_overlap_evaluation(tiny, test_ids, data_dir_module):
    valid_ids = tokenize(load_text("wikitext2", "valid", data_dir_module), tiny[1])
    split = calibration_split(valid_ids, 128, 32, 512, seed=0)
    evaluation = {tuple(w.tolist()) for w in perplexity_windows(test_ids, 512)}
    assert not evaluation & {
        tuple(w.tolist()) for w in torch.cat([split.calibration, split.heldout])
    }
