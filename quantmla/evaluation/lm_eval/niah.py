"""RULER S-NIAH-1/2/3 samples built offline, sized in the evaluated model's own tokenizer.

lm-eval's `niah_single_*` tasks download their haystack (essays over the network) and size it in
steps of 500 words, too coarse for short contexts. This builds the same samples (RULER's
template, needle sentence, key words, 7-digit numbers / UUIDs, 40 insertion depths and answer
prefix) from the local essays, with the haystack sized to the word so that prompt + generation
budget lands within a few tokens of each target length. Deterministic per seed."""

from __future__ import annotations

import random
import re
from functools import cache
from pathlib import Path

from quantmla.data.retrieval import random_value

ESSAYS = "niah-paul-graham-essays/PaulGrahamEssays"
# RULER's text, word for word (tests compare them with lm-eval's niah_utils / prepare_niah).
TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
    "all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT_HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
DEPTHS = [round(100 * i / 39) for i in range(40)]

# variant -> (haystack, needle value type); keys are adjective-noun words in all three.
VARIANTS = {
    "niah_single_1": ("repeat", "numbers"),
    "niah_single_2": ("essay", "numbers"),
    "niah_single_3": ("essay", "uuids"),
}


def essays_folder(data_dir) -> Path:
    return Path(data_dir) / ESSAYS


@cache
def essay_words(data_dir: str) -> tuple[str, ...]:
    """Every local essay (sorted by file name) as one whitespace-split word list."""
    folder = essays_folder(data_dir)
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays (*.txt) in {folder}")
    text = " ".join(f.read_text(encoding="utf-8") for f in files)
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


@cache
def key_vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """RULER's key vocabulary, wonderwords' adjectives and nouns (a key is `adjective-noun`)."""
    import wonderwords

    categories = wonderwords.RandomWord()._categories
    return tuple(sorted(set(categories["adjectives"]))), tuple(sorted(set(categories["nouns"])))


def random_key(rng: random.Random) -> str:
    adjectives, nouns = key_vocabulary()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def haystack_words(kind: str, n: int, data_dir) -> list[str]:
    """The first `n` words of the haystack (essays cycled if `n` exceeds them)."""
    source = essay_words(str(data_dir)) if kind == "essay" else tuple(REPEAT_HAYSTACK.split(" "))
    reps = -(-n // len(source))
    return list(source * reps)[:n]


def insert_needle(words: list[str], needle: str, depth: int) -> str:
    """Join the haystack with the needle after the sentence boundary nearest `depth` percent."""
    ends = [0] + [i + 1 for i, w in enumerate(words) if w.endswith((".", "!", "?"))]
    if ends[-1] != len(words):
        ends.append(len(words))
    cut = ends[min(range(len(ends)), key=lambda k: abs(ends[k] - len(words) * depth / 100))]
    return " ".join(words[:cut] + [needle] + words[cut:])


def make_sample(variant: str, n_words: int, rng: random.Random, data_dir) -> dict:
    kind, value_type = VARIANTS[variant]
    key = random_key(rng)
    value = random_value("number7" if value_type == "numbers" else "uuid", rng)
    singular = value_type[:-1]
    needle = NEEDLE.format(type_needle_v=value_type, key=key, value=value)
    context = insert_needle(haystack_words(kind, n_words, data_dir), needle, rng.choice(DEPTHS))
    # One needle, one query: RULER's singular rewrite of its template.
    template = (
        TEMPLATE.replace("Some", "A")
        .replace("are all", "is")
        .replace("are", "is")
        .replace("answers", "answer")
    )
    return {
        "input": template.format(type_needle_v=singular, context=context, query=key),
        "outputs": [value],
        "gen_prefix": f"The special magic {singular} for {key} mentioned in the provided text is",
        "needle": needle,
    }


def prompt_text(sample: dict) -> str:
    """What the model reads: lm-eval joins the input and the answer prefix with one space."""
    return sample["input"] + " " + sample["gen_prefix"]


def _length(tokenizer, sample: dict) -> int:
    return len(tokenizer(prompt_text(sample)).input_ids)


def fit_words(variant, budget, tokenizer, data_dir, seed) -> int:
    """Largest haystack (words) whose prompt fits `budget` tokens, for a reference needle."""

    def fits(n: int) -> bool:
        sample = make_sample(variant, n, random.Random(seed), data_dir)
        return _length(tokenizer, sample) <= budget

    lo, hi = 1, max(2, budget * 2)
    if not fits(lo):
        raise ValueError(f"{variant}: the template alone exceeds {budget} tokens")
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def generate(
    variant: str,
    max_seq_length: int,
    tokenizer,
    data_dir,
    num_samples: int,
    seed: int = 42,
    tokens_to_generate: int = 128,
) -> list[dict]:
    """`num_samples` samples whose prompt (input and answer prefix) + `tokens_to_generate` is
    ≤ `max_seq_length`, each with the haystack grown to the word to fill it (so lm-eval, given
    max_length = the largest length, never truncates a prompt)."""
    budget = max_seq_length - tokens_to_generate
    n_ref = fit_words(variant, budget, tokenizer, data_dir, seed)
    samples = []
    for index in range(num_samples):
        n = n_ref + 8  # needles differ by a few tokens: start a little above, shrink to fit
        while True:
            sample = make_sample(
                variant, n, random.Random(f"{seed}-{max_seq_length}-{index}"), data_dir
            )
            length = _length(tokenizer, sample)
            if length <= budget or n == 1:
                break
            n = max(1, n - max(1, (length - budget) // 2))
        samples.append(
            {
                "index": index,
                **sample,
                "length": length + tokens_to_generate,
                "max_length": max_seq_length,
            }
        )
    return samples


def niah_dataset(variant: str, **kwargs):
    """lm-eval `custom_dataset` entry: metadata gives `max_seq_lengths`, `tokenizer` (a path or
    hub id), `data_dir`, `num_samples` (per length) and `seed`."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kwargs["tokenizer"])
    rows = []
    for length in kwargs["max_seq_lengths"]:
        rows += generate(
            variant,
            int(length),
            tokenizer,
            kwargs["data_dir"],
            int(kwargs.get("num_samples", 500)),
            int(kwargs.get("seed", 42)),
        )
    return {"test": datasets.Dataset.from_list(rows)}
