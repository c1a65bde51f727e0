"""Synthetic retrieval documents for training a testbed that can find a needle (issue #13).

A document is a haystack — C4 *training-slice* text or our own filler sentences, never WikiText,
the Paul Graham essays (RULER's haystack) or an evaluation split — with one key–value needle at a
random depth and a question at the end; the answer follows the question. Needle and question
phrasings come in two disjoint sets: `TRAIN` phrasings for training, `HELDOUT` phrasings for the
retrieval evaluation, so the evaluation asks in words the model never saw. Values tokenize
compactly (short numbers, short words, short hex ids). Deterministic per seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Our own filler (not RULER's "The grass is green..." passage).
FILLER = (
    "A river bends around the old mill.",
    "Rain falls on the quiet town.",
    "The baker opens the shop at dawn.",
    "Clouds drift over the low hills.",
    "A cat sleeps by the warm stove.",
    "The road turns north past the farm.",
    "Children walk home after school.",
    "Wind moves through the tall grass.",
)
WORDS = (
    "amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "jasper",
    "kelp", "lantern", "maple", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "tundra",
)  # fmt: skip


@dataclass(frozen=True)
class Phrasing:
    needle: str  # with {key} and {value}
    question: str  # with {key}
    answer: str  # with {value}


TRAIN = (
    Phrasing("The magic number for {key} is {value}.", "What is the magic number for {key}?", " The magic number for {key} is {value}."),
    Phrasing("Remember this: the passkey of {key} is {value}.", "What is the passkey of {key}?", " The passkey of {key} is {value}."),
    Phrasing("Note that {key} has the secret code {value}.", "Which secret code does {key} have?", " {key} has the secret code {value}."),
    Phrasing("The id assigned to {key} is {value}.", "What id is assigned to {key}?", " The id assigned to {key} is {value}."),
)  # fmt: skip
HELDOUT = (
    Phrasing("Keep in mind that the special value of {key} equals {value}.", "Tell me the special value of {key}.", " The special value of {key} equals {value}."),
    Phrasing("For the record, {key} is linked to {value}.", "To what is {key} linked?", " {key} is linked to {value}."),
)  # fmt: skip
STYLES = ("number", "word", "uuid")


def random_value(style: str, rng: random.Random) -> str:
    if style == "number":
        return str(rng.randint(10**4, 10**6 - 1))
    if style == "word":
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
    return f"{rng.getrandbits(32):08x}"


def random_key(rng: random.Random) -> str:
    return f"{rng.choice(WORDS).capitalize()} {rng.randint(1, 99)}"


def filler_words(n_words: int, rng: random.Random) -> list[str]:
    words: list[str] = []
    while len(words) < n_words:
        words += rng.choice(FILLER).split(" ")
    return words[:n_words]


def haystack_words(n_words: int, rng: random.Random, documents: list[str] | None) -> list[str]:
    """`n_words` words of consecutive training documents from a random start (filler if None)."""
    if not documents:
        return filler_words(n_words, rng)
    words: list[str] = []
    i = rng.randrange(len(documents))
    while len(words) < n_words:
        words += documents[i % len(documents)].split()
        i += 1
    return words[:n_words]


def retrieval_document(
    n_words: int,
    rng: random.Random,
    documents: list[str] | None = None,
    phrasings=TRAIN,
    style: str | None = None,
) -> dict:
    """{"prompt", "answer", "value", "needle"}: haystack of `n_words` words with one needle at a
    random sentence boundary, then the question; `answer` is the continuation to learn/score."""
    phrasing = rng.choice(phrasings)
    key, value = random_key(rng), random_value(style or rng.choice(STYLES), rng)
    needle = phrasing.needle.format(key=key, value=value)
    words = haystack_words(n_words, rng, documents)
    ends = [0] + [i + 1 for i, w in enumerate(words) if w.endswith((".", "!", "?"))] + [len(words)]
    cut = rng.choice(ends)
    text = " ".join(words[:cut] + [needle] + words[cut:])
    return {
        "prompt": f"{text}\n{phrasing.question.format(key=key)}",
        "answer": phrasing.answer.format(key=key, value=value),
        "value": value,
        "needle": needle,
    }


def retrieval_documents(
    n: int, n_words: int, seed: int, documents=None, phrasings=TRAIN
) -> list[dict]:
    rng = random.Random(seed)
    return [retrieval_document(n_words, rng, documents, phrasings) for _ in range(n)]
