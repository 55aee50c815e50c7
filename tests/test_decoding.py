"""The one decoding module: validated SamplingParams, the sampler's rules, the stop rule.

Both `symbiont generate` and the serving engine decode with these; the end-to-end checks
against vanilla transformers live in test_generate_stream.py and test_serve_engine.py.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from symbiont.decoding import (
    FinishReason,
    InvalidSamplingParams,
    SamplingParams,
    TextTracker,
    make_generator,
    sample,
    stop_ids,
    token_finish,
)

VOCAB = 50


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -0.5),
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -2),
        ("seed", -1),
        ("seed", 2**64),
        ("n", 0),
        ("stop_token_ids", (-1,)),
        ("max_tokens", 2.5),
    ],
)
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field, "the error must name the offending field"
    assert field in str(err.value)


def test_a_huge_number_is_not_echoed_back_whole():
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(seed=10**400)
    assert "a number of 401 digits" in str(err.value) and len(str(err.value)) < 200


def test_empty_stop_strings_are_ignored_not_stopping_at_once():
    params = SamplingParams(stop=("", "END", ""))
    assert params.stop == ("END",)
    tracker = TextTracker(_CharTokenizer(), SamplingParams(stop=("",)).stop)
    assert tracker.update([ord("a"), ord("b")]) == "ab" and not tracker.stopped


def test_every_field_has_help_text():
    assert all(text.strip() for text in SamplingParams.help().values())


def test_top_k_minus_one_means_all_tokens_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0


def _rows(n=4, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed))


def _draw(logits, params, seed=0, times=1):
    """Tokens sampled from one row `times` times with one generator."""
    generator = make_generator(SamplingParams(**{**params, "seed": seed}))
    return [sample(logits, [SamplingParams(**params)], [generator])[0] for _ in range(times)]


def test_greedy_is_the_argmax_of_each_row():
    logits = _rows()
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _rows(1)
    want = int(logits.argmax())
    assert set(_draw(logits, {"temperature": 2.0, "top_k": 1}, times=20)) == {want}
    assert set(_draw(logits, {"temperature": 2.0, "top_p": 1e-300}, times=20)) == {want}


def test_top_k_samples_only_among_the_k_likeliest():
    logits = _rows(1, seed=3)
    allowed = set(logits[0].topk(5).indices.tolist())
    drawn = set(_draw(logits, {"temperature": 5.0, "top_k": 5}, times=200))
    assert drawn <= allowed, "top_k let a token outside the k likeliest through"
    assert len(drawn) > 1, "top_k 5 at a high temperature should vary"


def test_same_seed_same_tokens_and_choices_differ():
    logits = _rows(1)
    params = {"temperature": 1.0}
    assert _draw(logits, params, seed=5, times=10) == _draw(logits, params, seed=5, times=10)
    a, b = (make_generator(SamplingParams(seed=5), index=i) for i in (0, 1))
    first = [sample(logits, [SamplingParams()], [a])[0] for _ in range(10)]
    second = [sample(logits, [SamplingParams()], [b])[0] for _ in range(10)]
    assert first != second, "choices of one request must not share a random stream"


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    drawn = _draw(logits, {"temperature": 1.0}, times=3000)
    share = [drawn.count(t) / len(drawn) for t in range(3)]
    assert share == pytest.approx([0.7, 0.2, 0.1], abs=0.03)


def test_a_nan_row_does_not_crash_or_poison_the_others():
    logits = _rows(3)
    logits[1] = math.nan
    logits[2, 7] = math.inf
    params = [SamplingParams(temperature=1.0, seed=1)] * 3
    generators = [make_generator(p, i) for i, p in enumerate(params)]
    tokens = sample(logits, params, generators)
    assert all(0 <= t < VOCAB for t in tokens)
    assert tokens[2] == 7, "a row with an infinite logit falls back to its argmax"
    clean = sample(logits[:1], params[:1], [make_generator(params[0], 0)])
    assert tokens[0] == clean[0], "a bad row changed another row's sample"


def test_extreme_temperature_and_top_p_stay_finite():
    logits = _rows(2)
    params = [SamplingParams(temperature=2.0, top_p=1e-300), SamplingParams(temperature=1e-300)]
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert tokens == logits.argmax(-1).tolist()


def test_stop_rule():
    eos = frozenset({2})
    params = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    ends = stop_ids(params, eos)
    assert token_finish(2, 1, params, ends) is FinishReason.STOP
    assert token_finish(9, 1, params, ends) is FinishReason.STOP
    assert token_finish(5, 2, params, ends) is None
    assert token_finish(5, 3, params, ends) is FinishReason.LENGTH
    ignoring = SamplingParams(ignore_eos=True)
    assert token_finish(2, 1, ignoring, stop_ids(ignoring, eos)) is None


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_string_cuts_text_and_holds_back_its_prefix():
    tracker = TextTracker(_CharTokenizer(), ("##",))
    ids, out = [], []
    for char in "ab#c#":
        ids.append(ord(char))
        out.append(tracker.update(ids))
    assert "".join(out) == "ab#c", "a possible stop-string prefix must be held back"
    ids.append(ord("#"))
    out.append(tracker.update(ids))
    assert tracker.stopped and tracker.text == "ab#c" and "".join(out) == "ab#c"


def test_sampling_params_import_without_torch():
    code = "import sys, symbiont.decoding; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_text_tracker_decodes_from_an_anchor_exactly_as_the_whole_output(model_dir):
    """The incremental decode (anchor + tail) equals decoding the whole output at every
    token, multi-byte characters split across tokens and special tokens included."""
    from transformers import AutoTokenizer

    from symbiont.decoding import _decodes_by_bytes

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert _decodes_by_bytes(tokenizer), "the default tokenizer decodes byte-level"
    text = "héllo wörld — 漢字 and emoji 🙂🙃, then ascii again. " * 3
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    generator = torch.Generator().manual_seed(0)
    random_ids = torch.randint(0, len(tokenizer), (300,), generator=generator).tolist()
    for sequence in (ids, random_ids, ids[:40] + random_ids[:40] + ids[40:]):
        tracker = TextTracker(tokenizer, ())
        for n in range(1, len(sequence) + 1):
            tracker.update(sequence[:n])
            whole = tokenizer.decode(sequence[:n], skip_special_tokens=True)
            assert tracker.text == whole, f"differs after {n} tokens"
        assert tracker._anchor_ids, "the anchor moved up"
    tracker = TextTracker(tokenizer, ())  # an output that is not an extension resets it
    tracker.update(ids[:30])
    tracker.update(random_ids[:12])
    assert tracker.text == tokenizer.decode(random_ids[:12], skip_special_tokens=True)


class _BytesTokenizer:
    """Each id is some bytes; decoding joins them as UTF-8 (an incomplete character reads
    U+FFFD), as a byte-level BPE tokenizer splitting a character over two tokens does."""

    PIECES = [b" x", b"a", b"\xc3", b"\xa9", b" y", b"\xe2\x80"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def _released(stop, ids, final_at=None):
    tracker, out = TextTracker(_BytesTokenizer(), stop), []
    for n in range(1, len(ids) + 1):
        out.append(tracker.update(ids[:n], final=n == final_at))
    return "".join(out), tracker


def test_a_stop_string_ending_in_a_split_character_never_leaks_its_start():
    """With stop 'aé' and 'é' split over two tokens, the 'a' was released while the
    first half of 'é' (U+FFFD) was held: the client got ' xa' instead of ' x'."""
    text, tracker = _released(("aé",), [0, 1, 2, 3, 4])
    assert text == " x" and tracker.stopped
    text, tracker = _released(("aé",), [0, 1, 2, 4], final_at=4)  # 'a' then not 'é'
    assert text == " xa\ufffd y" and not tracker.stopped


def test_a_half_character_does_not_match_a_stop_string_of_u_fffd_until_final():
    tracker = TextTracker(_BytesTokenizer(), ("\ufffd",))
    assert tracker.update([0, 5]) == " x" and not tracker.stopped  # 2 of 3 bytes: may complete
    text, tracker = _released(("\ufffd",), [0, 5], final_at=2)  # it never completed
    assert text == " x" and tracker.stopped


def test_token_bytes_join_back_a_character_split_over_tokens(model_dir):
    """OpenAI's logprobs `bytes` exist to rebuild characters split over tokens: each
    token's own bytes, not the UTF-8 of U+FFFD its text alone decodes to."""
    from symbiont.decoding import token_bytes
    from symbiont.serve.http.render import Render, TokenNames, describe, token_names
    from symbiont.tenant import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer("héllo ✓", add_special_tokens=False).input_ids
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids), "no split character here"
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == "héllo ✓".encode()
    render = Render(tokenizer, as_ids=False, logprobs=None, echo=False, prompts=(), texts=())
    assert bytes(sum((render.bytes_of(i) for i in ids), [])) == "héllo ✓".encode()
    # the API process of symbiont serve shows them from the names the engine's process sent
    past = len(tokenizer) + 3  # an id of a padded embedding: no text
    names = TokenNames()
    names.update({**describe(tokenizer), "names": token_names(tokenizer, [*ids, past])})
    relayed = Render(names, as_ids=False, logprobs=None, echo=False, prompts=(), texts=())
    for i in [*ids, past]:
        assert relayed.bytes_of(i) == render.bytes_of(i)
        assert relayed.token(i) == render.token(i)
    assert relayed.token(past) == f"token_id:{past}"
