"""The server under lm-evaluation-harness' request shapes (issue 11 #17).

lm-eval is not a dependency; its `local-completions` model sends plain JSON, reproduced
here field for field and parsed as the harness parses it:

- loglikelihood (lm_eval/models/openai_completions.py, `_create_payload(generate=False)`):
  `{"model", "prompt": [context + continuation token ids, ...], "temperature": 0,
  "max_tokens": 1, "logprobs": 1, "seed", "echo": true}`; per choice (sorted by index) the
  harness sums `token_logprobs[ctxlen:-1]` and calls it greedy when every one of those
  equals `max(top_logprobs[i].values())`. The older shape (lm-eval 0.3, `gpt3`) sends
  `max_tokens: 0`, `logprobs: 10` and sums `token_logprobs[ctxlen:]`.
- generate_until: `{"prompt", "model", "max_tokens", "temperature": 0, "stop": until +
  [eos string], "seed"}`; the harness reads `choices[index]["text"]`.

Each number is checked against vanilla transformers + peft, base and adapters at once.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import Reference, add_char_tokenizer, make_adapters

ATOL = 1e-5
SEED = 1234  # lm-eval's default
ENGINE = EngineConfig(max_running=8, max_batched_tokens=16, block_size=4, num_blocks=256)
MODELS = ["tiny-llama", "lora4", "rslora2", "ia3"]
CONTEXTS = ["Question: what is 2+2?\nAnswer:", "The capital of France is", "Once upon a"]
CONTINUATIONS = [" 4", " Paris, of course", " time"]


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("served") / "tiny-llama"
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return make_adapters(model_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def server(model_dir, adapters):
    preloaded = tuple((name, str(adapters[name])) for name in MODELS[1:])
    config = ServerConfig(model=str(model_dir), adapters=preloaded, port=0, engine=ENGINE)
    with BackgroundServer(config) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir, adapters):
    return Reference(model_dir, adapters)


def adapter_of(model: str) -> str | None:
    return None if model == "tiny-llama" else model


def post_concurrently(server, payloads: list[dict]) -> list[dict]:
    """lm-eval with num_concurrent > 1: every payload in flight at once."""

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            url = f"{server.url}/v1/completions"
            return await asyncio.gather(*(client.post(url, json=p) for p in payloads))

    responses = asyncio.run(main())
    for response in responses:
        assert response.status_code == 200, response.text
    return [r.json() for r in responses]


def expected_loglikelihood(reference, model, context: list[int], continuation: list[int]):
    """(sum of the continuation's log-probabilities, whether it is the greedy one)."""
    tokens = context + continuation
    logits = reference.logits(tokens, adapter_of(model)).float()
    logp = torch.log_softmax(logits, dim=-1)
    rows = range(len(context), len(tokens))
    total = sum(float(logp[p - 1, tokens[p]]) for p in rows)
    greedy = all(int(logp[p - 1].argmax()) == tokens[p] for p in rows)
    return total, greedy


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """As lm-eval's LocalCompletionsAPI.parse_logprobs reads a response."""
    res = []
    for choice, ctxlen in zip(
        sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True
    ):
        assert ctxlen > 0
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(
            tok == max(top.values()) for tok, top in zip(logprobs, top_logprobs, strict=True)
        )
        res.append((sum(logprobs), is_greedy))
    return res


def requests_for(tokenizer, reference, model) -> tuple[list[list[int]], list[int], list[int]]:
    """(context, continuation) token ids as the harness builds them (no special tokens),
    plus each context's greedy continuation, so both is_greedy outcomes are covered."""
    contexts, continuations = [], []
    for context, continuation in zip(CONTEXTS, CONTINUATIONS, strict=True):
        ids = tokenizer(context, add_special_tokens=False).input_ids
        contexts += [ids, ids]
        continuations.append(tokenizer(continuation, add_special_tokens=False).input_ids)
        continuations.append(reference.generate(ids, adapter_of(model), 3))
    return contexts, continuations, [len(c) for c in contexts]


def test_loglikelihood_requests_of_several_models_at_once(server, tokenizer, reference):
    payloads, cases = [], []
    for model in MODELS:
        contexts, continuations, ctxlens = requests_for(tokenizer, reference, model)
        payloads.append(
            {
                "model": model,
                "prompt": [c + x for c, x in zip(contexts, continuations, strict=True)],
                "temperature": 0,
                "max_tokens": 1,
                "logprobs": 1,
                "seed": SEED,
                "echo": True,
            }
        )
        cases.append((model, contexts, continuations, ctxlens))
    outs = post_concurrently(server, payloads)
    greedy_seen = set()
    for (model, contexts, continuations, ctxlens), out in zip(cases, outs, strict=True):
        assert [c["index"] for c in out["choices"]] == list(range(len(contexts)))
        got = parse_logprobs(out, ctxlens)
        for i, (context, continuation) in enumerate(zip(contexts, continuations, strict=True)):
            want, greedy = expected_loglikelihood(reference, model, context, continuation)
            assert abs(got[i][0] - want) <= ATOL * len(continuation), (model, i, got[i], want)
            assert got[i][1] == greedy, (model, i)
            greedy_seen.add(greedy)
    assert greedy_seen == {True, False}, "both is_greedy outcomes must be exercised"


def test_loglikelihood_legacy_shape_with_max_tokens_zero_and_text(server, tokenizer, reference):
    """lm-eval 0.3: echo, max_tokens 0, logprobs 10, continuation = token_logprobs[ctxlen:];
    greedy when every continuation token is the key of its top_logprobs' maximum. Text
    prompts (tokenized_requests=False) with ctxlen from the harness' own tokenizer."""
    payloads, cases = [], []
    for model in MODELS:
        for context, continuation in zip(CONTEXTS, CONTINUATIONS, strict=True):
            payloads.append(
                {
                    "model": model,
                    "prompt": context + continuation,
                    "echo": True,
                    "max_tokens": 0,
                    "temperature": 0.0,
                    "logprobs": 10,
                }
            )
            cases.append((model, context, continuation))
    outs = post_concurrently(server, payloads)
    for (model, context, continuation), out in zip(cases, outs, strict=True):
        choice = out["choices"][0]
        assert choice["text"] == context + continuation
        ctx = tokenizer(context).input_ids
        cont = tokenizer(context + continuation).input_ids[len(ctx) :]
        ctxlen = len(ctx)
        lp = choice["logprobs"]
        total = sum(lp["token_logprobs"][ctxlen:])
        is_greedy = all(
            max(lp["top_logprobs"][i], key=lp["top_logprobs"][i].get) == lp["tokens"][i]
            for i in range(ctxlen, len(lp["tokens"]))
        )
        want, greedy = expected_loglikelihood(reference, model, ctx, cont)
        assert abs(total - want) <= ATOL * len(cont), (model, context)
        assert is_greedy == greedy
        assert all(len(top) <= 11 for top in lp["top_logprobs"][1:])


def expected_generation(reference, tokenizer, model, ids, max_tokens, stops) -> str:
    text = tokenizer.decode(
        reference.generate(ids, adapter_of(model), max_tokens), skip_special_tokens=True
    )
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


def test_generate_until_requests(server, tokenizer, reference):
    payloads, cases = [], []
    for model in MODELS:
        encodings = [tokenizer(c, add_special_tokens=False).input_ids for c in CONTEXTS]
        greedy = expected_generation(reference, tokenizer, model, encodings[0], 12, [])
        until = [greedy[4:6] or "\n\n"]  # a stop string the first generation does reach
        stop = [*until, tokenizer.eos_token]  # handle_stop_sequences appends the eos string
        payloads.append(
            {
                "prompt": encodings,  # batched, tokenized (lm-eval's default)
                "model": model,
                "max_tokens": 12,
                "temperature": 0,
                "stop": stop,
                "seed": SEED,
            }
        )
        cases.append((model, encodings, stop))
        payloads.append(  # batch_size 1, tokenized_requests=False: one text prompt
            {
                "prompt": CONTEXTS[1],
                "model": model,
                "max_tokens": 12,
                "temperature": 0,
                "stop": ["\n\n", tokenizer.eos_token],
                "seed": SEED,
            }
        )
        cases.append((model, [encodings[1]], ["\n\n", tokenizer.eos_token]))
    outs = post_concurrently(server, payloads)
    for (model, encodings, stop), out in zip(cases, outs, strict=True):
        texts = [None] * len(out["choices"])
        for choice in out["choices"]:  # lm-eval's parse_generations
            texts[choice["index"]] = choice["text"]
        want = [expected_generation(reference, tokenizer, model, e, 12, stop) for e in encodings]
        assert texts == want, model
    finishes = {c["finish_reason"] for out in outs for c in out["choices"]}
    assert "stop" in finishes, "no stop string was exercised"
