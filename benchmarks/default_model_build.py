"""How long the first `symbiont demo` waits for the embedded default model to build.

Builds the default checkpoint (tokenizer training, model init, pretraining, save) into a
fresh temporary folder `--rounds` times and prints each build's wall time and the median,
so the figure the docs quote is measured, not assumed. This replaces a unit test that
asserted the build time (timings do not belong in unit tests). It also checks what the
pretraining is for: greedy generation from the demo's prompt (the start of a corpus
passage) with vanilla transformers, and how many words match the corpus. Usage:

    python benchmarks/default_model_build.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from symbiont.model.default import (
    DefaultModelSpec,
    default_corpus,
    default_model,
    read_build_info,
)

PROMPT = "The central processing unit, usually called the CPU,"  # the demo's prompt


def greedy_continuation(folder: Path, prompt: str, new_tokens: int = 48) -> str:
    """What vanilla transformers generates greedily after `prompt` with the built model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    return tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True).strip()


def corpus_continuation(prompt: str) -> str:
    for paragraph in default_corpus().read_text(encoding="utf-8").split("\n\n"):
        if paragraph.strip().startswith(prompt):
            return paragraph.strip()[len(prompt) :]
    raise ValueError(f"no corpus paragraph starts with {prompt!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="builds to time (default 1)")
    args = parser.parse_args()
    spec = DefaultModelSpec()
    print(
        f"default model: {spec.num_hidden_layers} layers x {spec.hidden_size} hidden, "
        f"{spec.pretrain_steps} pretraining steps of {spec.batch_size} x {spec.sequence_length} "
        f"tokens on one thread, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    walls = []
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            folder = default_model(Path(tmp) / "model", rebuild=True)
            wall = time.perf_counter() - started
            info = read_build_info(folder)
            continuation = greedy_continuation(folder, PROMPT)
        walls.append(wall)
        losses = info["losses"]
        print(
            f"round {round_}: {wall:.1f} s wall ({info['build_seconds']:.1f} s recorded in the "
            f"marker); train loss {losses['train_loss_last_steps']:.3f}, held-out loss "
            f"{losses['held_out_loss_after']:.3f}"
        )
        truth = corpus_continuation(PROMPT).split()
        said = continuation.split()
        same = next((i for i, (a, b) in enumerate(zip(said, truth, strict=False)) if a != b), None)
        same = min(len(said), len(truth)) if same is None else same
        print(f"  greedy: {PROMPT} -> {continuation!r}")
        print(f"  the first {same} of {len(said)} generated words are the corpus's own")
    print(f"median build: {statistics.median(walls):.1f} s over {len(walls)} round(s)")


if __name__ == "__main__":
    main()
