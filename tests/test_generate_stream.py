"""Streaming generation: greedy equals vanilla, stop strings stop, seeded sampling repeats,
KV offload changes nothing in the output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import symbiont
from symbiont.decoding import (
    SamplingParams,
    TextTracker,
    generate,
    held_back,
)
from symbiont.tenant import load_tokenizer

PROMPT = "Q: What is 20 plus 19?\nA:"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def client(model_dir):
    executor = symbiont.BaseExecutor.from_pretrained(model_dir)
    return symbiont.load_client(model_dir, executor), load_tokenizer(model_dir)


def greedy(n=16, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_greedy_stream_matches_vanilla_generate(model_dir, client):
    model, tokenizer = client
    pieces = []
    result = generate(model, tokenizer, PROMPT, greedy(), on_text=pieces.append)
    vanilla = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = vanilla.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert list(result.token_ids) == want[0, ids.shape[1] :].tolist()
    assert len(pieces) > 1, "text must arrive in pieces as it is generated, not all at the end"
    assert "".join(pieces) == result.text
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_max_new_tokens_is_respected(client):
    model, tokenizer = client
    result = generate(model, tokenizer, PROMPT, greedy(n=3))
    assert len(result.token_ids) <= 3
    assert result.stop_reason in {"length", "eos"}


def test_stop_string_ends_generation_and_is_not_output(client):
    model, tokenizer = client
    full = generate(model, tokenizer, PROMPT, greedy(n=24))
    stop = full.text[len(full.text) // 2 :][:3]  # a piece from the middle of the output
    assert stop.strip(), f"need a visible stop string, output was {full.text!r}"
    pieces = []
    cut = generate(model, tokenizer, PROMPT, greedy(n=24, stop=(stop,)), on_text=pieces.append)
    assert cut.stop_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert "".join(pieces) == cut.text, "streamed text must not include (part of) the stop string"
    assert len(cut.token_ids) < len(full.token_ids), "generation must stop early, not run on"


def test_text_that_may_start_a_stop_string_isheld_back():
    assert held_back("hello ##", ("###",)) == 2
    assert held_back("hello", ("###",)) == 0
    assert held_back("ab\ufffd", ()) == 1, "incomplete UTF-8 must wait for its next byte"


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stream_releases_held_text_at_the_end():
    out, ids = [], []
    tracker = TextTracker(_CharTokenizer(), ("END",))
    for char in "ok EN":
        ids.append(ord(char))
        out.append(tracker.update(ids))
    assert "".join(out) == "ok " and not tracker.stopped
    out.append(tracker.update(ids, final=True))
    assert "".join(out) == "ok EN", "held-back text that never became a stop string is released"


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(client):
    model, tokenizer = client
    settings = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, top_k=100, seed=7)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a = generate(model, tokenizer, PROMPT, settings)
    assert torch.rand(1).equal(before), "seeded generation must not consume the caller's RNG"
    b = generate(model, tokenizer, PROMPT, settings)
    assert a.token_ids == b.token_ids, "same seed must give the same sample"
    others = {generate(model, tokenizer, PROMPT, SamplingParams(max_tokens=12, temperature=1.5, seed=s)).token_ids for s in range(4)}  # fmt: skip
    assert len(others) > 1, "different seeds should give different samples"


def test_kv_offload_output_equals_normal_output(client):
    model, tokenizer = client
    normal = generate(model, tokenizer, PROMPT, greedy(n=20))
    offloaded = generate(model, tokenizer, PROMPT, greedy(n=20), kv_offload="cpu")
    assert offloaded.token_ids == normal.token_ids


def test_settings_are_validated():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="kv_offload"):
        generate(None, None, PROMPT, greedy(), kv_offload="disk")
