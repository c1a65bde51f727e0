"""Synthetic retrieval documents: train the second testbed to find a needle, and test it (#13).

A document is a haystack — C4 *training-slice* text or our own filler sentences, never WikiText,
the Paul Graham essays (RULER's haystack) or an evaluation split — with a key–value needle at a
sentence boundary (sometimes beside distractor needles of other keys), then
`\\nQuestion: <question>\\nAnswer:` and the value. Training phrasings are procedural (frames ×
nouns × intros, free-form `{key} <random words> {value}.` needles, and `varied_phrasing`'s
arbitrary glue words around the key); the evaluation asks with
`HELDOUT` phrasings whose content words never occur in a training phrasing, so a model that
retrieves under them has learned retrieval, not templates. Documents are built in token space,
sized exactly; everything is a function of the `random.Random` passed in (deterministic per seed)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

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
STYLES = ("number", "word", "hex")
VALUE_STYLES = STYLES + ("number7", "uuid")

# Training phrasings: frames × nouns × intros, and free-form needles.
NOUNS = (
    "magic number", "passkey", "secret number", "access code", "pin code", "lucky number",
    "code", "serial number", "password", "ticket number", "combination", "token", "identifier",
    "account number", "room number", "special number",
)  # fmt: skip
INTROS = ("", "Remember: ", "Note that ", "Important: ", "Please memorize this: ", "By the way, ")
NEEDLE_FRAMES = (
    "the {noun} for {key} is {value}.",
    "{key}'s {noun} is {value}.",
    "{key} has the {noun} {value}.",
    "the {noun} of {key}: {value}.",
    "use {value} as the {noun} for {key}.",
    "{value} is the {noun} of {key}.",
)
QUESTION_FRAMES = (
    "What is the {noun} for {key}?",
    "What is {key}'s {noun}?",
    "Which {noun} does {key} have?",
    "Tell me the {noun} of {key}.",
    "{key}: which {noun}?",
    "Give the {noun} for {key}.",
)
FREE_QUESTIONS = ("What about {key}?", "{key}?", "And {key}?", "What goes with {key}?")

# Restated answers (our wording): the prompt ends in a declarative lead and the value follows it,
# as in long-context suites that put an answer prefix after the question.
LEADS = (
    "The {noun} for {key} is",
    "The {noun} of {key} is",
    "{key}'s {noun} is",
    "The {noun} for {key} given in the text above is",
    "The {noun} of {key} stated earlier is",
    "According to the text, the {noun} for {key} is",
    "The {noun} that was given for {key} is",
)
FREE_LEADS = ("{key} goes with", "The value for {key} is", "In the text, {key} was paired with")
JOINS = ("\nQuestion: {question}\nAnswer: {lead}", "\n{question} {lead}", "\n{question}\n{lead}")
HEADERS = (
    "Read the following text carefully and keep track of every {noun} in it.\n",
    "Below is a long text with a {noun} somewhere inside. A question about it follows.\n",
    "There is a {noun} in the passage below; you will need it later.\n",
)


@dataclass(frozen=True)
class Phrasing:
    needle: str  # with {key} and {value}
    question: str  # with {key}
    noun: str = ""  # what the value is called, for a restated answer ("" : free-form)


# Evaluation phrasings: none of HELDOUT_WORDS occurs in any training phrasing (tested).
HELDOUT = (
    Phrasing(
        "Keep in mind that the hidden figure attached to {key} stands at {value}.",
        "Which hidden figure stands attached to {key}?",
    ),
    Phrasing("For the record, {key} is linked to {value}.", "To what is {key} linked?"),
    Phrasing(
        "Somewhere it was written that {key} corresponds to {value}.",
        "What does {key} correspond to?",
    ),
    Phrasing(
        "The registry entry under {key} reads {value}.", "Look up the registry entry under {key}."
    ),
)
HELDOUT_WORDS = frozenset(
    [
        "keep",
        "mind",
        "hidden",
        "figure",
        "attached",
        "stands",
        "record",
        "linked",
        "somewhere",
        "written",
        "corresponds",
        "correspond",
        "registry",
        "entry",
        "under",
        "reads",
        "look",
    ]
)


@cache
def _wordlist(name: str, longest: int) -> tuple[str, ...]:
    """A wonderwords list: lowercase alphabetic words of 3..`longest` letters, held-out words out."""
    from wonderwords.random_word import _get_words_from_text_file as words

    return tuple(
        sorted(
            w
            for w in words(name)
            if w.isalpha() and w.islower() and 3 <= len(w) <= longest and w not in HELDOUT_WORDS
        )
    )


def _word_pool() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(adjectives, nouns): the words of keys and of free-form needles."""
    return _wordlist("adjectivelist.txt", 8), _wordlist("nounlist.txt", 8)


def random_key(rng: random.Random) -> str:
    adjectives, nouns = _word_pool()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def random_value(style: str, rng: random.Random) -> str:
    if style == "number":
        return str(rng.randint(10**3, 10**7 - 1))
    if style == "number7":  # RULER S-NIAH's magic numbers have seven digits
        return str(rng.randint(10**6, 10**7 - 1))
    if style == "word":
        return random_key(rng)
    if style == "hex":
        return f"{rng.getrandbits(32):08x}"
    if style == "uuid":  # RULER S-NIAH-3's values are UUIDs
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"value style {style!r}: allowed {VALUE_STYLES}")


def training_phrasing(rng: random.Random) -> Phrasing:
    """A fresh training phrasing: a frame with a noun and intro, or (half the time) free-form
    `{key} <1-3 random words> {value}.` (or value first) asked by a short question."""
    if rng.random() < 0.5:
        noun = rng.choice(NOUNS)
        needle = rng.choice(INTROS) + rng.choice(NEEDLE_FRAMES).replace("{noun}", noun)
        return Phrasing(needle, rng.choice(QUESTION_FRAMES).replace("{noun}", noun), noun)
    adjectives, nouns = _word_pool()
    middle = " ".join(rng.choice(adjectives + nouns) for _ in range(rng.randint(1, 3)))
    needle = (
        f"{{key}} {middle} {{value}}." if rng.random() < 0.75 else f"{{value}} {middle} {{key}}."
    )
    if rng.random() < 0.5:
        return Phrasing(needle, rng.choice(FREE_QUESTIONS))
    return Phrasing(needle, rng.choice(QUESTION_FRAMES).replace("{noun}", middle), middle)


# Glue words of varied phrasings (none of them held out: tested).
FUNCTION_WORDS = (
    "the", "a", "an", "to", "of", "at", "in", "on", "by", "for", "with", "from", "into", "as", "is",
    "was", "are", "be", "been", "has", "had", "have", "will", "can", "may", "then", "now", "also",
    "still", "just", "that", "this", "its", "their", "our", "and", "or", "but", "so", "very",
    "here", "there", "again", "always", "once", "today", "after", "before", "over", "near",
)  # fmt: skip
ASKS = ("what", "which", "tell me", "give me", "say", "name", "recall", "what is", "what was",
        "remind me", "do you know", "find")  # fmt: skip


def varied_phrasing(rng: random.Random) -> Phrasing:
    """A needle of arbitrary glue: `<0-4 words> {key} <1-5 words> {value}.` (a fifth value first),
    asked `<ask> {key} [<the needle's relation words>]?`: the key, not the template, finds the
    value (the held-out phrasings are of this shape, with words never drawn here)."""
    _, nouns = _word_pool()

    def words(n: int) -> str:
        pools = (FUNCTION_WORDS, FUNCTION_WORDS, _wordlist("verblist.txt", 9), nouns)
        return " ".join(rng.choice(rng.choice(pools)) for _ in range(n))

    intro = words(rng.randint(0, 4))
    relation = words(rng.randint(1, 5))
    if rng.random() < 0.8:
        needle = f"{intro} {{key}} {relation} {{value}}."
    else:
        needle = f"{intro} {{value}} {relation} {{key}}."
    tail = f" {relation}" if rng.random() < 0.5 else ""
    question = f"{rng.choice(ASKS)} {words(rng.randint(0, 2))} {{key}}{tail}{rng.choice('?.')}"
    return Phrasing(" ".join(needle.split()), " ".join(question.split()))


def heldout_phrasing(rng: random.Random) -> Phrasing:
    return rng.choice(HELDOUT)


def _fill(template: str, **fields: str) -> str:
    """The template's first letter capitalised (not a field's: a key is spelled one way only)."""
    template = template[:1].upper() + template[1:]
    for name, value in fields.items():
        template = template.replace("{" + name + "}", value)
    return template


@dataclass
class Sample:
    """One document in token space. `kinds[t]` says what token t is as a *target*: 0 not trained
    on, 1 language-model text (C4 haystack), 2 the answer (value and the EOS after it)."""

    ids: list[int]
    kinds: list[int]
    prompt_len: int  # tokens up to and including "Answer:"
    value: str
    key: str


class RetrievalSampler:
    """Builds retrieval documents of an exact token length from a tokenizer and a haystack: a token
    stream of documents (`haystack_ids`, e.g. the C4 training slice) or, when None, our filler."""

    def __init__(self, tokenizer, haystack_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.haystack = haystack_ids
        self.filler = [self.encode(" " + s) for s in FILLER]
        if haystack_ids is not None:
            vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            # a token after which a sentence ends (byte-level BPE: "Ġ" marks a leading space)
            self.sentence_end = [
                t is not None and t.rstrip("Ċ").endswith((".", "!", "?")) for t in vocab
            ]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _haystack(self, n: int, rng: random.Random) -> tuple[list[int], list[int]]:
        """n haystack tokens and the positions where a needle may go (sentence boundaries)."""
        if self.haystack is None:
            ids, cuts = [], [0]
            while len(ids) < n:
                ids += rng.choice(self.filler)
                cuts.append(len(ids))
            return ids[:n], [c for c in cuts if c <= n]
        start = rng.randrange(len(self.haystack) - n)
        ids = list(self.haystack[start : start + n])
        cuts = [0] + [i + 1 for i, t in enumerate(ids) if self.sentence_end[t]] + [n]
        return ids, cuts

    def sample(
        self,
        length: int,
        rng: random.Random,
        phrasing: Callable[[random.Random], Phrasing] = training_phrasing,
        style: str | None = None,
        distractors: int = 0,
        questions: int = 1,
        restate: bool = False,
    ) -> Sample:
        """A document of exactly `length` tokens: haystack with the needle and `distractors`
        needles of other keys (same phrasing, other values) at random sentence boundaries, then
        `questions` question/answer pairs about distinct needles, the first needle asked last:
        "\nQuestion: …\nAnswer: <value>", EOS after the last. `prompt_len` and `value` are the
        last question's (training asks several at once: more answer tokens per document).
        `restate`: the prompt may open with an instruction header, and each answer follows a
        restated lead ("… The passkey for <key> is <value>") in one of `JOINS`' layouts."""
        if not 1 <= questions <= distractors + 1:
            raise ValueError(f"questions={questions}: allowed 1..{distractors + 1} (the needles)")
        style = style or rng.choice(STYLES)
        form = phrasing(rng)
        keys: list[str] = []
        while len(keys) < distractors + 1:
            key = random_key(rng)
            if key not in keys:
                keys.append(key)
        values = [random_value(style, rng) for _ in keys]
        needles = [
            self.encode(" " + _fill(form.needle, key=k, value=v)) for k, v in zip(keys, values)
        ]
        asked = list(range(1, distractors + 1))
        rng.shuffle(asked)
        asked = asked[: questions - 1] + [0]
        join, lead, header = "\nQuestion: {question}\nAnswer:", "", []
        if restate:
            join = rng.choice(JOINS)
            lead = rng.choice(LEADS if form.noun else FREE_LEADS).replace("{noun}", form.noun)
            if form.noun and rng.random() < 0.5:
                header = self.encode(_fill(rng.choice(HEADERS), noun=form.noun))
        qa = [
            (
                self.encode(
                    join.replace("{question}", _fill(form.question, key=keys[i])).replace(
                        "{lead}", _fill(lead, key=keys[i])
                    )
                ),
                self.encode(" " + values[i]) + ([self.eos] if n == len(asked) - 1 else []),
            )
            for n, i in enumerate(asked)
        ]
        n_hay = length - len(header) - sum(map(len, needles)) - sum(len(q) + len(a) for q, a in qa)
        if n_hay < 0:
            raise ValueError(f"length {length} is too short for a retrieval document")
        hay, cuts = self._haystack(n_hay, rng)
        text_kind = 0 if self.haystack is None else 1
        places = sorted((rng.choice(cuts), i) for i in range(len(needles)))
        ids, kinds, prev = list(header), [0] * len(header), 0
        for cut, i in places:
            ids += hay[prev:cut] + needles[i]
            kinds += [text_kind] * (cut - prev) + [0] * len(needles[i])
            prev = cut
        ids += hay[prev:]
        kinds += [text_kind] * (n_hay - prev)
        for question, answer in qa:
            ids += question
            kinds += [0] * len(question)
            prompt_len = len(ids)
            ids += answer
            kinds += [2] * len(answer)
        return Sample(ids, kinds, prompt_len, values[0], keys[0])
