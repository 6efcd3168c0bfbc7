"""``jargon_next``: a small, offline, public-domain multiple-choice task for smoke evaluations.

Built from gmc's held-out Jargon File text (``gmc/data/heldout.txt``, public domain, never used
for calibration). Each item shows the first sentence of a lexicon paragraph and asks for its true
second sentence among four: the true one and the second sentences of three other paragraphs
(seeded), about a hundred items. Chance is 0.25. It is a HellaSwag-like sentence-continuation check that a pruned model
still tracks local discourse, not a substitute for the paper's six tasks.

The items are rebuilt deterministically at load time (lm-eval calls ``load`` through
``custom_dataset`` in ``jargon_next.yaml``); ``python -m gmc.tasks.jargon_next out.jsonl`` writes
them to a JSONL file for inspection.
"""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

HELDOUT = Path(__file__).resolve().parent.parent / "data" / "heldout.txt"
SEED = 1234
MAX_ITEMS = 200
CHOICES = 4
_SENTENCE_END = re.compile(r"(?<=[a-z0-9\)”’\"'][.!?])\s+(?=[A-Z“\"])")


def _first_two_sentences(paragraph: str) -> tuple[str, str] | None:
    paragraph = re.sub(r"^\d+\.\s+", "", paragraph.replace("\xa0", " ").strip())  # drop a sense number "2. "
    sentences = _SENTENCE_END.split(paragraph)
    if len(sentences) < 2:
        return None
    first, second = sentences[0].strip(), sentences[1].strip()
    if not (40 <= len(first) <= 300 and 25 <= len(second) <= 200):
        return None
    return first, second


def build_items(text: str | None = None, seed: int = SEED, max_items: int = MAX_ITEMS) -> list[dict]:
    """``[{"context", "choices", "label"}]`` over the held-out paragraphs."""
    text = HELDOUT.read_text(encoding="utf-8") if text is None else text
    pairs = [pair for line in text.splitlines() if (pair := _first_two_sentences(line))]
    pairs = list({second: (first, second) for first, second in reversed(pairs)}.values())[::-1]  # unique answers
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    items = []
    for index in order[:max_items]:
        context, true = pairs[index]
        others = rng.sample([i for i in range(len(pairs)) if i != index], CHOICES - 1)
        choices = [true] + [pairs[i][1] for i in others]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(true)})
    return items


def load(**_):
    """lm-eval ``custom_dataset`` hook: a DatasetDict with one ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(build_items())})


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "jargon_next.jsonl")
    out.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in build_items()))
    print(f"wrote {out}")
