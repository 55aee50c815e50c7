"""Output processing: sampled tokens -> finish decisions, incremental text, deltas.

For every sequence that got a token this iteration: append it, apply the shared stop
rule (`symbiont.decoding.token_finish`, the context limit, stop strings through the
sequence's `TextTracker`) and collect what is newly final (text, and the token's
log-probability when asked for) into one `RequestOutput` per request; the prompt's
log-probabilities go out once, with the output of the iteration that scored its last
token. A prompt-only sequence (`max_tokens` 0) ends with "length" once its prompt is
scored. Finished sequences are handed back to the engine, which frees them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from symbiont.decoding import FinishReason, TokenLogprob, stop_ids, token_finish
from symbiont.serve.sequence import Request, RequestOutput, SeqDelta, Sequence


class EngineObserver:
    """Receives timing events (the Prometheus metrics implement it); no-op by default."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_inter_token(self, seconds: float) -> None: ...

    def on_tokens(self, n: int) -> None: ...

    def on_request(self, adapter: str | None) -> None:
        """A request was queued for `adapter` (None: the base model)."""

    def on_adapter_cache(self, tier: str, hit: bool) -> None:
        """A request found its adapter in `tier` ("resident", "host") or not."""

    def on_adapter_load(self, seconds: float, ok: bool) -> None:
        """An adapter was read from disk into host memory (or failed to be)."""

    def on_adapter_evict(self, tier: str) -> None:
        """An adapter left `tier` ("resident": its slot; "host": host memory)."""


class OutputProcessor:
    def __init__(self, eos_ids: frozenset[int], max_model_len: int, observer: EngineObserver):
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.observer = observer

    def append(
        self,
        request: Request,
        produced: list[tuple[Sequence, int | None, TokenLogprob | None]],
        finish: Callable,
    ) -> tuple[SeqDelta, ...]:
        """Add one token (and its log-probability, if asked for) to each of a request's
        sequences; token None ends a prompt-only sequence. `finish(seq)` frees one that
        ended. -> the request's deltas of this iteration."""
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
            self.observer.on_first_token(now - request.arrival)
        deltas = []
        for seq, token, logprob in produced:
            if token is None:
                seq.finish_reason = FinishReason.LENGTH
                deltas.append(SeqDelta(seq.index, (), "", seq.finish_reason))
            else:
                if seq.last_token_time is not None:
                    self.observer.on_inter_token(now - seq.last_token_time)
                seq.last_token_time = now
                deltas.append(self._advance(seq, token, logprob))
            if seq.finish_reason is not None:
                finish(seq)
        return tuple(deltas)

    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> SeqDelta:
        seq.token_ids.append(token)
        output = seq.output_ids
        ends = stop_ids(seq.params, self.eos_ids)
        seq.finish_reason = token_finish(token, len(output), seq.params, ends)
        if seq.finish_reason is None and len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        text = ""
        if seq.text is not None:
            by_token = seq.finish_reason is FinishReason.STOP
            text = seq.text.update(
                output[:-1] if by_token else output, seq.finish_reason is not None
            )
            if seq.text.stopped:
                seq.finish_reason = FinishReason.STOP
        logprobs = None if logprob is None else (logprob,)
        return SeqDelta(seq.index, (token,), text, seq.finish_reason, logprobs)


def request_output(request: Request, deltas: tuple[SeqDelta, ...], finished: bool) -> RequestOutput:
    completion = sum(len(s.output_ids) for s in request.sequences)
    prompt = len(request.prompt_ids)
    prompt_logprobs = None
    if request.prompt_scored and not request.prompt_logprobs_sent:
        request.prompt_logprobs_sent = True
        prompt_logprobs = tuple(request.prompt_logprobs)
    return RequestOutput(
        request.request_id, deltas, prompt, completion, finished, request.error, prompt_logprobs
    )
