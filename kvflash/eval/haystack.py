"""Needle-in-a-haystack material: seeded, varied filler prose and needles, nothing downloaded."""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = [
    "The old lighthouse keeper",
    "A travelling merchant",
    "The village baker",
    "Our geography teacher",
    "The night nurse",
    "A young cartographer",
    "The harbour master",
    "My grandmother",
    "The librarian",
    "A retired sailor",
    "The orchard farmer",
    "The museum guide",
    "A visiting botanist",
    "The blacksmith",
    "The station clerk",
    "A wandering painter",
    "The mayor's secretary",
    "The ferry captain",
]
VERBS = [
    "walked along",
    "wrote a letter about",
    "often spoke of",
    "carefully repaired",
    "painted a picture of",
    "complained about",
    "kept a diary about",
    "drew a map of",
    "sang a song about",
    "argued about",
    "made a list of",
    "remembered",
    "photographed",
    "read an old book about",
    "planted flowers near",
]
OBJECTS = [
    "the quiet river",
    "the northern hills",
    "the crowded market",
    "the abandoned mill",
    "the stone bridge",
    "the winter storms",
    "the narrow streets",
    "the copper kettle",
    "the chestnut trees",
    "the railway line",
    "the fishing boats",
    "the town clock",
    "the salt marshes",
    "the lavender fields",
    "the empty theatre",
    "the broken fence",
    "the long summer evenings",
]
CODAS = [
    "before the sun went down",
    "while the rain kept falling",
    "during the long autumn",
    "as the church bells rang",
    "on a cold and windy morning",
    "after the harvest festival",
    "when nobody else was watching",
    "with great patience",
    "for most of the afternoon",
    "without saying a word to anyone",
    "in the spring of that year",
    "despite the heavy fog",
]
ASIDES = [
    "Nobody in the village could remember a time when things had been different.",
    "The neighbours said it was the best work they had seen in years.",
    "It was the kind of day that people talk about for a long time afterwards.",
    "Some of the children followed along, asking questions the whole way.",
    "Later, over supper, the story was told again with a few new details.",
    "The weather changed twice before evening, as it often did there.",
]

KEYS = [
    "amber-falcon",
    "quiet-harbor",
    "silver-meadow",
    "copper-lantern",
    "northern-orchid",
    "velvet-canyon",
    "hollow-pine",
    "crimson-tide",
    "frozen-maple",
    "golden-thistle",
    "misty-garden",
    "rapid-heron",
]


@dataclass(frozen=True)
class NeedleTemplate:
    needle: str
    question: str


PASSCODE = NeedleTemplate(
    needle="The secret passcode is {value}. Remember it: the secret passcode is {value}.",
    question="What is the secret passcode mentioned in the text above? Answer with the number only.",
)
RULER = NeedleTemplate(
    needle="One of the special magic numbers for {key} is: {value}.",
    question="What is the special magic number for {key} mentioned in the provided text?",
)
TEMPLATES = {"passcode": PASSCODE, "ruler": RULER}


def filler_sentences(rng: random.Random):
    """An endless stream of varied sentences."""
    while True:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CODAS)}."
        yield s
        if rng.random() < 0.2:
            yield rng.choice(ASIDES)


def needle_value(rng: random.Random) -> str:
    """A 5-7 digit number with no repeated runs or sequences a model might guess (1234, 7777...)."""
    while True:
        v = str(rng.randrange(10_000, 10_000_000))
        runs = any(v[i] == v[i + 1] for i in range(len(v) - 1))
        steps = any(
            int(v[i + 1]) - int(v[i]) in (1, -1) and int(v[i + 2]) - int(v[i + 1]) in (1, -1)
            for i in range(len(v) - 2)
        )
        if not runs and not steps:
            return v


@dataclass(frozen=True)
class Haystack:
    document: str
    question: str
    value: str
    needle_char: int
    needle_len: int


def build_haystack(
    n_tokens: int,
    depth: float,
    seed: int,
    count_tokens,
    template: NeedleTemplate = PASSCODE,
    filler: str | None = None,
) -> Haystack:
    """A document of about n_tokens (by count_tokens) with the needle at relative depth 0..1."""
    rng = random.Random(seed)
    value, key = needle_value(rng), rng.choice(KEYS)
    needle = template.needle.format(value=value, key=key)
    if filler is None:
        sents = filler_sentences(rng)
        parts, approx = [], 0
        while approx < n_tokens * 1.1:
            s = next(sents)
            parts.append(s)
            approx += len(s) // 4 + 1
        text = " ".join(parts)
    else:
        text = filler
    # Trim to the budget by token count (binary search on sentence boundaries).
    sentences = text.split(". ")
    lo, hi = 1, len(sentences)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(". ".join(sentences[:mid])) + count_tokens(needle) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    sentences = sentences[:lo]
    at = round(depth * len(sentences))
    before = ". ".join(sentences[:at]) + ("." if at else "")
    after = ". ".join(sentences[at:])
    document = (before + " " + needle + " " + after).strip()
    at_char = len(before) + 1 if before else 0  # the strip took the space before a needle at depth 0
    return Haystack(document, template.question.format(key=key), value, at_char, len(needle))
