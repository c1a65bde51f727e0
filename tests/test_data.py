import pytest
import torch

from quantmla.data import (
    calibration_split,
    load_documents,
    load_text,
    perplexity_windows,
    sensitivity_cell,
    sources,
)
from quantmla.errors import ConfigError


def test_wikitext_rows_and_gptq_join(data_dir):
    rows = load_documents("wikitext2", "test", data_dir)
    assert len(rows) == 4358  # = HF wikitext-2-raw-v1 test rows
    assert len(load_documents("wikitext2", "valid", data_dir)) == 3760
    assert rows[0] == "" and rows[1] == " = Robert Boulter = \n"
    assert load_text("wikitext2", "test", data_dir) == "\n\n".join(rows)


def test_c4_train_and_eval_slices_are_disjoint(data_dir):
    train = load_documents("c4", "train", data_dir)
    evaluation = load_documents("c4", "eval", data_dir)
    assert len(train) + len(evaluation) == 2000 and len(evaluation) == sources.C4_EVAL_DOCS
    assert not set(train) & set(evaluation)


def test_gsm8k_train(data_dir):
    docs = load_documents("gsm8k", "train", data_dir)
    assert len(docs) == 7473 and docs[0].startswith("Question: Natalia")


def test_env_var_points_at_data(data_dir, monkeypatch):
    monkeypatch.setenv(sources.DATA_DIR_ENV, str(data_dir))
    assert len(load_documents("wikitext2", "valid")) == 3760


def test_hub_path_is_used_without_local_dir(monkeypatch):
    """No data dir and no env var: the hub loader runs (mocked: no network in tests)."""
    import datasets

    monkeypatch.delenv(sources.DATA_DIR_ENV, raising=False)
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return {"text": ["a\n", "", "b\n"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_text("wikitext2", "test") == "a\n\n\n\n\nb\n"
    assert calls == [("Salesforce/wikitext", "wikitext-2-raw-v1", "test")]


IDS = torch.arange(10_000)


def test_perplexity_windows_are_consecutive_and_drop_the_tail():
    w = perplexity_windows(IDS, 512)
    assert w.shape == (19, 512) and torch.equal(w.flatten(), IDS[: 19 * 512])
    assert perplexity_windows(IDS, 512, max_windows=3).shape == (3, 512)


def test_calibration_and_heldout_disjoint_and_seeded():
    split = calibration_split(IDS, n_calib=12, n_heldout=4, seqlen=256, seed=3)
    assert split.calibration.shape == (12, 256) and split.heldout.shape == (4, 256)
    calib_tokens = set(split.calibration.flatten().tolist())
    assert not calib_tokens & set(split.heldout.flatten().tolist())  # token ids = positions here
    again = calibration_split(IDS, 12, 4, 256, seed=3)
    other = calibration_split(IDS, 12, 4, 256, seed=4)
    assert torch.equal(again.calibration, split.calibration)
    assert not torch.equal(other.calibration, split.calibration)
    # disjoint from evaluation too: each calibration window is one aligned, non-overlapping slot
    assert all(int(row[0]) % 256 == 0 for row in split.calibration)


def test_calibration_split_too_large_is_a_clear_error():
    with pytest.raises(ConfigError, match="at most 39 windows"):
        calibration_split(IDS, 38, 2, 256, seed=0)


def test_sensitivity_cells():
    cell = sensitivity_cell(IDS, seed=1, n_sequences=8, seqlen=512)
    assert cell.shape == (8, 512)
    assert len(set(cell.flatten().tolist())) == 8 * 512
    assert torch.equal(cell, sensitivity_cell(IDS, seed=1, n_sequences=8, seqlen=512))


def test_unigram_perplexity_is_the_exponentiated_entropy_of_the_targets():
    import math

    from quantmla.evaluation.perplexity import unigram_perplexity

    windows = torch.tensor([[7, 1, 1, 2], [9, 2, 2, 2]])  # targets: 1,1,2 and 2,2,2 -> p = 1/3, 2/3
    entropy = -(1 / 3) * math.log(1 / 3) - (2 / 3) * math.log(2 / 3)
    assert unigram_perplexity(windows) == pytest.approx(math.exp(entropy), rel=1e-12)
    assert unigram_perplexity(torch.tensor([[0, 5, 5, 5]])) == pytest.approx(1.0)


class _FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a fixed function of the token ids (float32, large vocabulary)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(
            torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) * 4
        )

    def forward(self, ids):
        return type("Out", (), {"logits": self.table[ids]})()


def test_window_nll_matches_float64_and_resumes_in_whole_batches():
    from quantmla.evaluation.perplexity import window_nll

    vocab, model = 4096, _FixedLogits(4096)
    windows = torch.randint(0, vocab, (5, 33), generator=torch.Generator().manual_seed(2))
    logp = torch.log_softmax(model.table.double()[windows[:, :-1]], dim=-1)
    expected = -logp.gather(-1, windows[:, 1:, None]).squeeze(-1).mean(dim=1)
    nll = window_nll(model, windows, batch_size=2)
    assert nll.dtype == torch.float64 and torch.allclose(nll, expected, rtol=0, atol=1e-6)
    saved = []
    # 3 windows done: only the whole batch (2) is kept; the rest is measured again
    resumed = window_nll(
        model, windows, batch_size=2, done=[9.0, 9.0, 9.0], save=lambda nll: saved.append(len(nll))
    )
    assert resumed[:2].tolist() == [9.0, 9.0] and torch.allclose(
        resumed[2:], expected[2:], atol=1e-6
    )
    assert saved == [4, 5]
