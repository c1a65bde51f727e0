"""The synthetic retrieval documents of the second testbed (#13): exact length, deterministic per
seed, the answer where the targets say, held-out phrasings disjoint from every training phrasing,
and no evaluation text in anything the generator makes."""

import random
import re

import pytest

from quantmla.data import load_documents
from quantmla.data.retrieval import (
    FILLER,
    HELDOUT,
    HELDOUT_WORDS,
    RetrievalSampler,
    heldout_phrasing,
    random_key,
    random_value,
    training_phrasing,
    varied_phrasing,
)
from tests.conftest import DATA_DIR, TINY_MLA


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MLA)


@pytest.fixture(scope="module")
def c4_train_ids(tokenizer):
    if not DATA_DIR.is_dir():
        pytest.skip("needs the shared data")
    ids = []
    for enc in tokenizer(load_documents("c4", "train", DATA_DIR)[:300], add_special_tokens=False)[
        "input_ids"
    ]:
        ids += enc + [tokenizer.eos_token_id]
    return ids


def _samples(sampler, seed, n=12, length=300, **kw):
    rng = random.Random(seed)
    return [sampler.sample(length, rng, **kw) for _ in range(n)]


@pytest.mark.parametrize("haystack", ["filler", "c4"])
def test_documents_are_exact_deterministic_and_answer_where_the_targets_say(
    haystack, tokenizer, request
):
    ids = request.getfixturevalue("c4_train_ids") if haystack == "c4" else None
    sampler = RetrievalSampler(tokenizer, ids)
    a = _samples(sampler, 3, distractors=1)
    assert [s.ids for s in a] == [s.ids for s in _samples(sampler, 3, distractors=1)]
    assert [s.ids for s in a] != [s.ids for s in _samples(sampler, 4, distractors=1)]
    for s in a:
        assert len(s.ids) == len(s.kinds) == 300
        answer = [t for t, k in zip(s.ids, s.kinds) if k == 2]
        assert answer == s.ids[s.prompt_len :]
        assert tokenizer.decode(answer) == f" {s.value}{tokenizer.eos_token}"
        prompt = tokenizer.decode(s.ids[: s.prompt_len])
        assert prompt.endswith("\nAnswer:") and prompt.count(s.value) == 1
        assert prompt.count(s.key) == 2  # in the needle and in the question; distractors differ
        text = [k == 1 for k in s.kinds[: s.prompt_len]]
        assert any(text) == (haystack == "c4")
        if haystack == "c4":  # haystack targets are C4-train tokens, in order
            hay = [t for t, k in zip(s.ids, s.kinds) if k == 1]
            joined = ",".join(map(str, ids))
            assert ",".join(map(str, hay[:20])) in joined


def test_restated_answers_follow_a_lead_that_names_the_key(tokenizer):
    """`restate`: the same exact-length document, the answer after a restated lead (optionally an
    instruction header first); none of it is RULER's wording."""
    from quantmla.evaluation.lm_eval.niah import NEEDLE, TEMPLATE

    sampler = RetrievalSampler(tokenizer)
    plain = _samples(sampler, 7, n=24, distractors=1, questions=2)
    restated = _samples(sampler, 7, n=24, distractors=1, questions=2, restate=True)
    assert [s.ids for s in restated] == [
        s.ids for s in _samples(sampler, 7, n=24, distractors=1, questions=2, restate=True)
    ]
    layouts = set()
    for s in restated:
        assert len(s.ids) == len(s.kinds) == 300
        assert tokenizer.decode(s.ids[s.prompt_len :]) == f" {s.value}{tokenizer.eos_token}"
        prompt = tokenizer.decode(s.ids[: s.prompt_len])
        last = prompt.rsplit("\n", 1)[1]
        assert s.key in last and last.endswith((" is", " with")), last
        layouts.add(prompt.rsplit("\n", 2)[-2].startswith("Question: "))
    assert layouts == {True, False}
    assert [s.ids for s in plain] != [s.ids for s in restated]
    theirs = set()
    for v in ("number", "numbers", "uuid", "uuids"):
        theirs |= _shingles(TEMPLATE.format(type_needle_v=v, context="", query="k"), 4)
        theirs |= _shingles(NEEDLE.format(type_needle_v=v, key="k", value="1"), 4)
    for s in restated:
        prompt = tokenizer.decode(s.ids[: s.prompt_len]).replace("\n", " ")
        assert not _shingles(prompt, 4) & theirs


def test_uuid_values_match_ruler_s_uuid_form():
    value = random_value("uuid", random.Random(0))
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value
    )
    with pytest.raises(ValueError, match="uuid"):
        random_value("guid", random.Random(0))


def test_heldout_phrasings_share_no_content_word_with_training_phrasings():
    """10,000 training phrasings (frames and free-form needles with random words) never use a word
    of the held-out phrasings, and every held-out phrasing uses at least two of them."""
    rng = random.Random(0)
    seen = set()
    for _ in range(10_000):
        for p in (training_phrasing(rng), varied_phrasing(rng)):
            seen |= set(re.findall(r"[a-z]+", (p.needle + " " + p.question).lower()))
    assert not seen & HELDOUT_WORDS
    for p in HELDOUT:
        words = set(re.findall(r"[a-z]+", (p.needle + " " + p.question).lower()))
        assert len(words & HELDOUT_WORDS) >= 2
    assert len({training_phrasing(rng) for _ in range(2000)}) > 1500  # not a handful of templates
    assert len({varied_phrasing(rng) for _ in range(2000)}) == 2000
    for _ in range(200):  # the key finds the value: it is in the needle and in the question
        p = varied_phrasing(rng)
        assert (
            p.needle.count("{key}") == p.needle.count("{value}") == p.question.count("{key}") == 1
        )
    assert heldout_phrasing(random.Random(1)) in HELDOUT
    assert not any(w in HELDOUT_WORDS for w in random_key(random.Random(2)).split("-"))


def _shingles(text: str, n: int = 8) -> set:
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="needs the shared data")
def test_generated_text_never_contains_evaluation_text(tokenizer):
    """Everything the generator writes (filler haystacks, needles, questions) shares no 8-word
    shingle with WikiText-2, the C4 evaluation slice or RULER's essays (C4-haystack documents add
    only C4-train text, which the data layer keeps disjoint from the evaluation slice)."""
    sampler = RetrievalSampler(tokenizer)
    ours = set()
    for s in _samples(sampler, 1, n=40, length=400, distractors=2):
        ours |= _shingles(tokenizer.decode(s.ids))
    evaluation = load_documents("c4", "eval", DATA_DIR)
    evaluation += load_documents("wikitext2", "test", DATA_DIR)
    evaluation += load_documents("wikitext2", "valid", DATA_DIR)
    evaluation += [p.read_text() for p in (DATA_DIR / "niah-paul-graham-essays").rglob("*.txt")]
    theirs = set().union(*(_shingles(t) for t in evaluation))
    assert ours and not ours & theirs
    joined = " ".join(evaluation)
    assert not any(f in joined for f in FILLER)
    assert set(load_documents("c4", "train", DATA_DIR)).isdisjoint(
        load_documents("c4", "eval", DATA_DIR)
    )


def test_several_questions_each_answered_by_its_own_needle(tokenizer):
    """Training documents ask about up to every needle; each answer is the value written beside
    the asked key, the first needle is asked last, and only the last answer ends in EOS."""
    sampler = RetrievalSampler(tokenizer)
    for s in _samples(sampler, 5, n=8, length=400, distractors=3, questions=3):
        text = tokenizer.decode(s.ids)
        pairs = re.findall(r"Question: .*?([a-z]+-[a-z]+).*?\nAnswer: ([\w-]+)", text)
        assert len(pairs) == 3 and pairs[-1] == (s.key, s.value)
        for key, value in pairs:
            needle = next(
                line for line in text.split(". ") if key in line and "Question" not in line
            )
            assert value in needle
        answers = [t for t, k in zip(s.ids, s.kinds) if k == 2]
        assert answers.count(tokenizer.eos_token_id) == 1 and answers[-1] == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="questions=3"):
        sampler.sample(300, random.Random(0), distractors=1, questions=3)
