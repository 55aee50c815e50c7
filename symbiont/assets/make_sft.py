"""Generate ``sft.jsonl``, the small fine-tuning set bundled with the default model.

Run ``python symbiont/assets/make_sft.py`` to regenerate it. The output is a pure
function of ``SEED`` and the word list below, so regenerating must reproduce the
committed file byte for byte (a test checks this).

The tasks are chosen so that a tiny model can visibly learn them within a few dozen
LoRA steps: every prompt in a task shares one fixed template, and every completion
is short and fully determined by the prompt. Completions start with a space because
the prompts end right before the answer, as a plain-text "question: answer" would.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 1234
RECORDS_PER_TASK = 50
OUTPUT_PATH = Path(__file__).with_name("sft.jsonl")

# Short, common English words that the corpus-trained tokenizer splits into few tokens.
WORDS = [
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "bird",
    "fish",
    "rice",
    "soup",
    "salt",
    "tea",
    "bread",
    "egg",
    "cake",
    "milk",
    "rain",
    "snow",
    "wind",
    "lake",
    "river",
    "hill",
    "rock",
    "sand",
    "star",
    "map",
    "city",
    "road",
    "ship",
    "train",
    "book",
    "pen",
    "code",
    "file",
    "byte",
    "loop",
    "data",
    "test",
    "bug",
    "key",
    "lamp",
    "door",
    "cup",
    "bowl",
    "fork",
    "apple",
    "lemon",
    "onion",
    "bean",
    "corn",
    "leaf",
    "root",
    "seed",
    "bee",
    "wolf",
    "frog",
    "duck",
    "goat",
    "lion",
    "blue",
    "red",
    "green",
    "gold",
    "pink",
    "gray",
    "warm",
    "cold",
    "fast",
    "slow",
    "soft",
    "hard",
    "loud",
    "calm",
]

Record = dict[str, str]


def addition(rng: random.Random) -> Record:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return {"prompt": f"Q: What is {a} plus {b}?\nA:", "completion": f" {a + b}"}


def subtraction(rng: random.Random) -> Record:
    a = rng.randint(0, 20)
    b = rng.randint(0, a)  # keep answers non-negative: simpler for a tiny model
    return {"prompt": f"Q: What is {a} minus {b}?\nA:", "completion": f" {a - b}"}


def next_number(rng: random.Random) -> Record:
    n = rng.randint(0, 98)
    return {"prompt": f"Q: What number comes after {n}?\nA:", "completion": f" {n + 1}"}


def reverse_word(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"prompt": f"Reverse the word '{word}':", "completion": f" {word[::-1]}"}


def uppercase_word(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"prompt": f"Write '{word}' in capital letters:", "completion": f" {word.upper()}"}


def first_letter(rng: random.Random) -> Record:
    word = rng.choice(WORDS)
    return {"prompt": f"Q: What is the first letter of '{word}'?\nA:", "completion": f" {word[0]}"}


TASKS: tuple[Callable[[random.Random], Record], ...] = (
    addition,
    subtraction,
    next_number,
    reverse_word,
    uppercase_word,
    first_letter,
)


def generate_records(seed: int = SEED, per_task: int = RECORDS_PER_TASK) -> list[Record]:
    """Return the shuffled records; identical for identical arguments."""
    rng = random.Random(seed)
    records = [task(rng) for task in TASKS for _ in range(per_task)]
    # Shuffle so that any prefix of the file (e.g. a short training run) mixes all tasks.
    rng.shuffle(records)
    return records


def render_jsonl(records: list[Record]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    output = Path(args[0]) if args else OUTPUT_PATH
    records = generate_records()
    output.write_text(render_jsonl(records), encoding="utf-8")
    print(f"wrote {len(records)} records to {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
