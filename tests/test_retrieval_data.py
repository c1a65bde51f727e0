"""The synthetic retrieval documents of the second testbed (#13): deterministic per seed, one
needle, held-out phrasings disjoint from training ones, and no evaluation text anywhere."""

import random

import pytest

from quantmla.data import load_documents
from quantmla.data.retrieval import FILLER, HELDOUT, TRAIN, retrieval_document, retrieval_documents
from tests.conftest import DATA_DIR


def test_generator_is_deterministic_per_seed_with_one_needle():
    a = retrieval_documents(20, 300, seed=3)
    assert a == retrieval_documents(20, 300, seed=3)
    assert a != retrieval_documents(20, 300, seed=4)
    for doc in a:
        assert doc["prompt"].count(doc["needle"]) == 1
        assert doc["value"] in doc["answer"] and doc["prompt"].count(doc["value"]) == 1


def test_heldout_phrasings_share_no_template_with_training():
    train = {p.needle for p in TRAIN} | {p.question for p in TRAIN}
    assert not train & ({p.needle for p in HELDOUT} | {p.question for p in HELDOUT})
    doc = retrieval_document(100, random.Random(0), phrasings=HELDOUT)
    assert any(doc["needle"].startswith(p.needle.split("{")[0]) for p in HELDOUT)


def _ngrams(text: str, n: int = 8) -> set:
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data")
def test_documents_never_contain_evaluation_text():
    """8-word shingles of 50 C4-haystack and 50 filler documents vs WikiText-2 test/valid, the C4
    evaluation slice and RULER's essays: no shared shingle."""
    train = load_documents("c4", "train", DATA_DIR)
    docs = retrieval_documents(50, 400, seed=1, documents=train)
    docs += retrieval_documents(50, 400, seed=2)
    ours = set().union(*(_ngrams(d["prompt"]) for d in docs))
    evaluation = load_documents("c4", "eval", DATA_DIR)
    evaluation += load_documents("wikitext2", "test", DATA_DIR) + load_documents(
        "wikitext2", "valid", DATA_DIR
    )
    evaluation += [p.read_text() for p in (DATA_DIR / "niah-paul-graham-essays").rglob("*.txt")]
    theirs = set().union(*(_ngrams(t) for t in evaluation))
    assert ours and not ours & theirs
    assert not any(f in " ".join(evaluation) for f in FILLER)
