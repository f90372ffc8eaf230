"""Writes demo/harbor_chronicle.txt: a long, original (CC0) document with facts worth asking about.

The filler is kvflash's seeded haystack prose; the facts are spread through it at fixed depths.
Run: python demo/make_document.py
"""

from __future__ import annotations

import random
from pathlib import Path

from kvflash.eval.haystack import filler_sentences

FACTS = [
    "The lighthouse of Port Elden was built in 1843 by an engineer named Mara Quill.",
    "The town's annual lantern festival is held on the second Saturday of October.",
    "The ferry between Port Elden and Gull Island takes forty minutes and leaves every two hours.",
    "Port Elden's oldest bakery, the Copper Oven, is famous for its rye bread with caraway seeds.",
    "The harbour master in the year of the great storm was a woman called Edda Morrow.",
    "The great storm destroyed the old wooden pier in the winter of 1911.",
    "The stone bridge over the river Fenn has exactly seven arches.",
    "The town library holds a collection of four thousand sea charts.",
    "The mill by the river was turned into a museum of weaving in 1978.",
    "Every child in Port Elden learns to row before the age of ten.",
]


def main() -> None:
    rng = random.Random(2026)
    sents = filler_sentences(rng)
    paragraphs = []
    for i in range(105):
        para = " ".join(next(sents) for _ in range(5))
        if i % 10 == 5:
            para += " " + FACTS[i // 10]
        paragraphs.append(para)
    text = "The Chronicle of Port Elden\n\n" + "\n\n".join(paragraphs) + "\n"
    Path(__file__).with_name("harbor_chronicle.txt").write_text(text)


if __name__ == "__main__":
    main()
