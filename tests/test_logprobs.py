"""Log-probabilities from the serving engine equal vanilla transformers + peft.

Issue 11 #17: prompt and sampled-token log-probabilities are the log-softmax of the
model's raw logits; whatever shares the batch (other adapters, the base, requests that
ask for nothing, chunked prefill across iterations) each request's values must equal
vanilla peft's within 1e-5 (fp32), with the same top-N alternatives and ranks.
"""

from __future__ import annotations

import pytest
import torch

from symbiont import BaseExecutor, load_client
from symbiont.serve import Engine, EngineConfig, FinishReason, Request, SamplingParams
from symbiont.serve.http.protocol import ChatRequest, CompletionRequest
from tests.test_serve_common import Reference, make_adapters, prompts

ATOL = 1e-5
# Small budget: prompts of up to 20 tokens are prefilled in chunks over several iterations.
SMALL = EngineConfig(max_running=8, max_batched_tokens=12, block_size=4, num_blocks=256)


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    base = checkpoints("llama")
    adapters = make_adapters(base, tmp_path_factory.mktemp("adapters"))
    engine = Engine(load_client(base, BaseExecutor.from_pretrained(base)), SMALL)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine, adapters, Reference(base, adapters)


def run(engine: Engine, requests: list[Request]) -> dict[str, dict]:
    """Drive the engine; -> request id -> prompt logprobs, per-choice token logprobs."""
    for request in requests:
        engine.add_request(request)
    seen = {r.request_id: {"prompt": None, "tokens": {}, "finish": {}} for r in requests}
    steps = 0
    while engine.has_work() and steps < 500:
        for output in engine.step():
            assert output.error is None, output.error
            got = seen[output.request_id]
            if output.prompt_logprobs is not None:
                assert got["prompt"] is None, "prompt logprobs were sent twice"
                got["prompt"] = output.prompt_logprobs
            for delta in output.deltas:
                if delta.logprobs is not None:
                    got["tokens"].setdefault(delta.index, []).extend(delta.logprobs)
                if delta.finish_reason:
                    got["finish"][delta.index] = delta.finish_reason
        steps += 1
    assert not engine.has_work()
    return seen


def reference_logprobs(reference: Reference, tokens: list[int], adapter) -> torch.Tensor:
    """[len(tokens), vocab] log-softmax of vanilla peft's logits (fp32)."""
    return torch.log_softmax(reference.logits(tokens, adapter).float(), dim=-1)


def check_position(got, want_row: torch.Tensor, token: int, n: int, where: str) -> None:
    assert got.token_id == token, where
    assert abs(got.logprob - float(want_row[token])) <= ATOL, (
        f"{where}: {got.logprob} != {float(want_row[token])}"
    )
    assert got.rank == int((want_row > want_row[token]).sum()) + 1, where
    values, ids = want_row.topk(n)
    assert [t for t, _ in got.top] == ids.tolist(), f"{where}: top-{n} ids differ"
    assert torch.allclose(torch.tensor([v for _, v in got.top]), values, atol=ATOL), where


def test_prompt_and_token_logprobs_in_a_mixed_chunked_batch(setup):
    engine, adapters, reference = setup
    names = [None, *adapters]
    batch = prompts(2 * len(names), seed=4, low=3, high=20)
    requests = []
    for i, prompt in enumerate(batch):
        asks = i % 3 != 2  # every third request asks for nothing and must not change
        params = SamplingParams(
            max_tokens=5,
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=i,
            logprobs=(i % 4) if asks else None,
            prompt_logprobs=(3 + i % 2) if asks else None,
        )
        requests.append(Request(f"m{i}", prompt, names[i % len(names)], params))
    seen = run(engine, requests)
    for request in requests:
        got, name, params = seen[request.request_id], request.adapter, request.params
        generated = request.sequences[0].output_ids
        want = reference_logprobs(reference, request.prompt_ids + generated, name)
        if params.prompt_logprobs is None:
            assert got["prompt"] is None and got["tokens"] == {}
            continue
        prompt = request.prompt_ids
        assert len(got["prompt"]) == len(prompt) and got["prompt"][0] is None
        for p in range(1, len(prompt)):
            where = f"{request.request_id} ({name}) prompt token {p}"
            check_position(got["prompt"][p], want[p - 1], prompt[p], params.prompt_logprobs, where)
        tokens = got["tokens"][0]
        assert len(tokens) == len(generated)
        for j, token in enumerate(generated):
            row = want[len(prompt) + j - 1]  # raw log-softmax: temperature does not change it
            where = f"{request.request_id} ({name}) generated token {j}"
            check_position(tokens[j], row, token, params.logprobs, where)
    assert engine.kv_cache.allocator.num_free == SMALL.num_blocks, "KV blocks leaked"


def test_max_tokens_zero_scores_the_prompt_only(setup):
    engine, adapters, reference = setup
    prompt = prompts(1, seed=9, low=17, high=17)[0]  # longer than one iteration's budget
    params = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1, n=2)
    request = Request("p0", prompt, "lora16", params)
    seen = run(engine, [request])["p0"]
    assert seen["finish"] == {0: FinishReason.LENGTH, 1: FinishReason.LENGTH}
    assert all(seq.output_ids == [] for seq in request.sequences)
    want = reference_logprobs(reference, prompt, "lora16")
    total = sum(seen["prompt"][p].logprob for p in range(1, len(prompt)))
    expected = sum(float(want[p - 1, prompt[p]]) for p in range(1, len(prompt)))
    assert abs(total - expected) <= ATOL * len(prompt)
    assert engine.kv_cache.allocator.num_free == SMALL.num_blocks


def test_logprob_parameters_are_validated():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)  # generating nothing needs prompt_logprobs
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    assert "logprobs" not in SamplingParams.help(), "serving-only fields are not CLI flags"
    assert CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True).max_tokens == 0
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=21)
