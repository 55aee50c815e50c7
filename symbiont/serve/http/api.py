"""The OpenAI-compatible HTTP API (FastAPI): the `model` field picks the adapter.

`model` equal to the served base name uses no adapter; any loaded adapter's name uses
that adapter, as in vLLM, SGLang and LoRAX, so existing OpenAI clients work unchanged.
Errors are OpenAI-style JSON: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from symbiont.decoding import InvalidSamplingParams, SamplingParams, token_bytes
from symbiont.serve.adapter_cache import AdapterFailed, AdapterState
from symbiont.serve.adapters import AdapterError, AdapterNotFound
from symbiont.serve.async_engine import AsyncEngine, EngineStopped, RequestStream
from symbiont.serve.engine import RequestError
from symbiont.serve.http.jobs import mount_jobs, tenant_of
from symbiont.serve.http.metrics import ServeMetrics
from symbiont.serve.http.protocol import (
    AdapterLoad,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    now,
    usage,
)
from symbiont.serve.http.relay import RELAY_HEADER, SPEC_HEADER, valid_relay_id
from symbiont.serve.scheduler import QueueFull
from symbiont.serve.sequence import Request as EngineRequest
from symbiont.serve.sequence import RequestOutput

log = logging.getLogger(__name__)

# Used when a tokenizer has no chat template of its own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self) -> JSONResponse:
        body = error_body(str(self), self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


@dataclass
class ServerState:
    """What the app serves; `engine` is None while the model loads (HTTP 503)."""

    model_name: str
    model_path: str
    api_key: str | None = None
    adapter_dir: str | None = None  # dynamic adapter loads only from under it
    max_request_bytes: int = 8 * 1024 * 1024
    jobs_dir: str | None = None  # fine-tuning jobs API (symbiont/serve/http/jobs.py)
    tenants: str | None = None  # tenants file: keys, limits, isolation (jobs.py)
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    engine: AsyncEngine | None = None
    load_error: str | None = None
    relay: object | None = None  # CoreRelay with --api-process: outputs go to that process
    # adapter name -> the tenant whose POST /v1/adapters loaded it: with --tenants only
    # that tenant may unload it (what the operator loaded at start serves every tenant)
    loaded_by: dict[str, str] = field(default_factory=dict)

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            why = self.load_error or "the model is still loading; retry shortly"
            raise APIError(503, why, "service_unavailable", code="loading")
        if not self.engine.alive:
            why = self.engine.error or "the server is shutting down"
            raise APIError(503, f"{why}; restart the server", "service_unavailable", code="failed")
        return self.engine


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="symbiont", summary="Many adapters, one frozen base, OpenAI API")
    app.state.serve = state
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=state.max_request_bytes)
    _install_auth(app, state)  # outermost: no body is read for an unauthenticated request

    @app.get("/health")
    async def health():
        state.ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        await _rescan(state)
        return {"object": "list", "data": _model_cards(state)}

    @app.get("/v1/adapters")
    async def adapters():
        return {"object": "list", "data": await _adapter_cards(state)}

    @app.post("/v1/adapters")
    async def load_adapter(body: AdapterLoad, http: Request):
        _check_text(body)
        engine = state.ready()
        if body.name == state.model_name:
            raise APIError(400, "an adapter may not take the base model's name", *_invalid("name"))
        card = await engine.load_adapter(body.name, _adapter_path(state.adapter_dir, body.path))
        state.loaded_by[body.name] = tenant_of(http)
        return card

    @app.delete("/v1/adapters/{name}")
    async def unload_adapter(name: str, http: Request):
        engine, cache = state.ready(), _cache(state)
        loaded = name in engine.engine.adapters.names()
        if loaded and state.tenants is not None:
            _check_may_unload(state, http, name)
        if not loaded and cache is not None and cache.state(name) is not None:
            raise APIError(
                400,
                f"adapter {name!r} is served from --adapter-dir, not loaded by name; move its "
                "folder out of the adapter folder to stop serving it (the cache evicts it when "
                "unused)",
                *_invalid("name"),
            )
        await engine.unload_adapter(name)
        state.loaded_by.pop(name, None)
        return {"id": name, "object": "adapter", "deleted": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_text(body)
        prompts = await _off_loop(_completion_prompts, state, body)
        _check_token_ids(state, prompts)
        texts = await _off_loop(_completion_texts, state, body) if body.echo else None
        return await _serve(state, body, prompts, http, chat=False, texts=texts)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        _check_text(body)
        prompt = await _off_loop(_chat_prompt, state, body)
        return await _serve(state, body, [prompt], http, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_text(body)
        if body.messages is not None and not body.messages:
            raise APIError(
                400, "messages is empty; send at least one message", *_invalid("messages")
            )
        return await _off_loop(_tokenize, state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await _off_loop(_detokenize, state, body)

    mount_jobs(app, state)  # files, fine-tuning jobs, tenants (outermost middleware)
    warm_imports_at_startup(app)
    return app


def warm_imports_at_startup(app) -> None:
    """anyio imports its asyncio backend at the first streamed response: 0.1-0.3 s holding
    the GIL, during which the engine thread waited (the first requests' TTFT)."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(application):
        async with anyio.create_task_group():
            pass
        async with inner(application) as maybe_state:
            yield maybe_state

    app.router.lifespan_context = lifespan


# Tokenizing and rendering chat templates take seconds for a multi-megabyte prompt: on
# the event loop that stalled every other client (streams, /health). One thread, so the
# tokenizer is never used by two requests at once (transformers sets its truncation
# state per call).
_TOKENIZING = ThreadPoolExecutor(1, thread_name_prefix="symbiont-tokenize")


async def _off_loop(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZING, fn, *args)


def _check_may_unload(state: ServerState, http: Request, name: str) -> None:
    """With --tenants, a tenant unloads only what it loaded by name or fine-tuned itself;
    the tenant gate already answers 404 for another tenant's fine-tuned model."""
    tenant = tenant_of(http)
    if state.loaded_by.get(name) == tenant or http.app.state.jobs.owner(name) == tenant:
        return
    who = "another tenant" if name in state.loaded_by else "the operator, at start"
    raise APIError(
        403,
        f"adapter {name!r} was loaded by {who} and serves every tenant; a tenant may unload "
        "only adapters it loaded with POST /v1/adapters or fine-tuned itself",
        "permission_error",
        "name",
        "adapter_not_yours",
    )


# -- request handling -------------------------------------------------------------------


async def _serve(
    state: ServerState,
    body,
    prompts: list[list[int]],
    http: Request,
    chat: bool,
    texts: list[str] | None = None,
):
    """`texts`: the prompts as text, shown before the completion with `echo`."""
    engine = state.ready()
    adapter = _adapter_of(state, body.model)
    relay_id = http.headers.get(RELAY_HEADER) if state.relay is not None else None
    if relay_id is not None and not valid_relay_id(relay_id):
        raise APIError(400, f"malformed {RELAY_HEADER} header", "invalid_request_error")
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = relay_id or f"{prefix}-{uuid.uuid4().hex}"
    requests = [
        EngineRequest(
            f"{request_id}-{i}", prompt, adapter, _sampling(engine, body, prompt, chat, adapter)
        )
        for i, prompt in enumerate(prompts)
    ]
    render = _render(engine, body, prompts, texts, chat)
    async with _adapter_in_memory(state, adapter) as counted:
        for request in requests:
            request.adapter_counted = counted
        streams = await _submit_all(engine, requests, state.relay if relay_id else None)
    view = _View(request_id, body.model, chat, body.n, now(), render)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    if relay_id is not None:  # the API process shows the outputs (front.py)
        spec = view.spec([r.request_id for r in requests], body.stream, include_usage)
        return JSONResponse(spec, headers={SPEC_HEADER: "1"})
    count = _counter(state.metrics)
    if body.stream:
        events = _sse(engine, streams, view, include_usage, count)
        return StreamingResponse(events, media_type="text/event-stream")
    return await _complete(engine, streams, view, http, count)


def _counter(metrics: ServeMetrics):
    """How an HTTP request's outcome is counted ("ok", "error", "disconnected")."""
    return lambda outcome: metrics.requests.labels(outcome).inc()


@contextlib.asynccontextmanager
async def _adapter_in_memory(state: ServerState, adapter: str | None):
    """For an --adapter-dir adapter: hold it and wait (without blocking the engine or
    other requests) until it is in host memory, so that a failed load is this request's
    4xx naming the adapter; the engine holds its own reference once it has the request.
    Yields whether the cache lookup was counted here."""
    cache = _cache(state)
    if adapter is None or cache is None or adapter in state.ready().engine.adapters.names():
        yield False
        return
    loaded = cache.reserve(adapter)  # counts this request's cache hit or miss
    try:
        # shielded: the load is shared by every request for this adapter, and a cancelled
        # waiter would otherwise cancel it while queued, leaving it 'loading' for everyone
        await asyncio.shield(asyncio.wrap_future(loaded))
        yield True
    finally:
        cache.release(adapter)


async def _submit_all(
    engine: AsyncEngine, requests: list[EngineRequest], sink=None
) -> list[RequestStream]:
    streams = []
    try:
        for request in requests:
            streams.append(await engine.submit(request, sink))
    except BaseException:
        for stream in streams:
            engine.abort(stream.request_id)
        raise
    return streams


def _sampling(
    engine: AsyncEngine, body, prompt: list[int], chat: bool, adapter: str | None
) -> SamplingParams:
    max_tokens = body.token_limit() if chat else body.max_tokens
    if max_tokens is None:  # chat default: whatever context is left (virtual tokens too)
        context = engine.engine.max_model_len
        left = context - len(prompt) - engine.engine.virtual_count(adapter)
        if left < 1:  # the client sent no max_tokens: name what it did send
            raise APIError(
                400,
                f"the messages take {len(prompt)} tokens, leaving none of the model's context "
                f"of {context} tokens to answer in; shorten the messages",
                *_invalid("messages"),
            )
        max_tokens = left
    logprobs, prompt_logprobs = _logprob_counts(body, chat, max_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        n=body.n,
        stop=body.stops(),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _logprob_counts(body, chat: bool, max_tokens: int) -> tuple[int | None, int | None]:
    """(alternatives per generated token, per prompt token); None = not computed."""
    if chat:
        if body.top_logprobs and not body.logprobs:
            raise APIError(
                400, "top_logprobs needs logprobs: true; set both", *_invalid("top_logprobs")
            )
        return _asked_logprobs(body, chat), None
    if max_tokens == 0 and not body.echo:
        raise APIError(
            400,
            "max_tokens: must be >= 1; 0 is allowed only with echo: true, which returns the "
            "prompt (with logprobs: N, its log-probabilities) and generates nothing",
            *_invalid("max_tokens"),
        )
    if not body.echo:
        return body.logprobs, None
    if body.logprobs is None:  # echo alone shows no logprobs; max_tokens 0 still scores
        return None, (0 if max_tokens == 0 else None)
    return body.logprobs, body.logprobs


def _asked_logprobs(body, chat: bool) -> int | None:
    """Alternatives per generated token the request asked for; None = no logprobs."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _render(engine: AsyncEngine, body, prompts, texts, chat: bool) -> _Render:
    tokenizer = engine.engine.tokenizer
    echo = bool(getattr(body, "echo", False))
    if echo and texts is None:
        texts = [_decode(tokenizer, p) for p in prompts]
    return _Render(
        tokenizer,
        body.return_tokens_as_token_ids,
        _asked_logprobs(body, chat),
        echo,
        tuple(tuple(p) for p in prompts),
        tuple(texts or ()),
    )


def _decode(tokenizer, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def _clamp(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the model rules out shows -9999.0, as in vLLM."""
    return max(logprob, -9999.0) if logprob == logprob else -9999.0


@dataclass(frozen=True)
class _Render:
    """How tokens and log-probabilities are shown, and the prompts for `echo`.

    Token strings are each token decoded alone ("token_id:<id>" with
    `return_tokens_as_token_ids`, without a tokenizer, or for an id past the tokenizer's
    vocabulary, as in models whose embedding is padded). Completions use the legacy
    shape (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob} with the N
    likeliest plus the chosen token, `text_offset` as the running sum of the token strings'
    lengths from the choice's text start); chat uses `{"content": [{token, logprob, bytes,
    top_logprobs}]}` with exactly the N likeliest. The first prompt token has no logprob."""

    tokenizer: object | None
    as_ids: bool
    logprobs: int | None  # None: the response carries `logprobs: null`
    echo: bool
    prompts: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    names: dict = field(default_factory=dict, compare=False)  # token id -> string

    def token(self, token_id: int) -> str:
        name = self.names.get(token_id)
        if name is None:
            known = self.tokenizer is not None and token_id < len(self.tokenizer)
            if self.as_ids or not known:  # ids past the tokenizer's vocabulary have no text
                name = f"token_id:{token_id}"
            else:
                name = self.tokenizer.decode([token_id])
            self.names[token_id] = name
        return name

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's own bytes (OpenAI's `bytes`: a character split over tokens joins
        back from them), else the UTF-8 of its text."""
        raw = None
        if self.tokenizer is not None and not self.as_ids and token_id < len(self.tokenizer):
            raw = token_bytes(self.tokenizer, token_id)
        return list(raw if raw is not None else self.token(token_id).encode())

    def completion(self, token_ids, entries, offset: int) -> tuple[dict, int]:
        """Legacy completions logprobs of `token_ids` (entries: TokenLogprob or None each),
        text offsets starting at `offset` -> (object, offset after the last token)."""
        tokens, values, tops, offsets = [], [], [], []
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        for token_id, entry in zip(token_ids, entries, strict=True):
            name = self.token(token_id)
            tokens.append(name)
            offsets.append(offset)
            # a special token (the BOS the tokenizer adds) has no text in `text`
            offset += 0 if token_id in special else len(name)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_clamp(entry.logprob))
            top = {self.token(t): _clamp(v) for t, v in entry.top}
            top.setdefault(name, _clamp(entry.logprob))
            tops.append(top)
        body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
        return {**body, "text_offset": offsets}, offset

    def chat(self, entries) -> dict:
        return {"content": [self._chat_entry(e) for e in entries]}

    def _chat_entry(self, entry) -> dict:
        name = self.token(entry.token_id)
        top = [
            {"token": self.token(t), "logprob": _clamp(v), "bytes": self.bytes_of(t)}
            for t, v in entry.top
        ]
        return {
            "token": name,
            "logprob": _clamp(entry.logprob),
            "bytes": self.bytes_of(entry.token_id),
            "top_logprobs": top,
        }


class _Choice:
    """What one choice has produced so far."""

    def __init__(self):
        self.text, self.tokens, self.entries = "", [], []
        self.finish = None

    def add(self, delta) -> None:
        self.text += delta.text
        self.tokens += delta.token_ids
        self.entries += delta.logprobs or [None] * len(delta.token_ids)
        if delta.finish_reason:
            self.finish = delta.finish_reason


@dataclass(frozen=True)
class _View:
    """How engine outputs are shown: ids, object names, choice numbering, logprobs."""

    id: str
    model: str
    chat: bool
    n: int
    created: int
    render: _Render

    def spec(self, request_ids: list[str], stream: bool, include_usage: bool) -> dict:
        """Everything another process needs to show this request's outputs as this one
        would (`symbiont serve --api-process`; `from_spec` reads it back)."""
        render = self.render
        return {
            "request_ids": request_ids,
            "stream": bool(stream),
            "include_usage": include_usage,
            "view": [self.id, self.model, self.chat, self.n, self.created],
            "render": [
                render.as_ids,
                render.logprobs,
                render.echo,
                [list(p) for p in render.prompts],
                list(render.texts),
            ],
        }

    @classmethod
    def from_spec(cls, spec: dict, tokenizer) -> _View:
        as_ids, logprobs, echo, prompts, texts = spec["render"]
        render = _Render(
            tokenizer, as_ids, logprobs, echo, tuple(tuple(p) for p in prompts), tuple(texts)
        )
        return cls(*spec["view"], render)

    def chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def echoed(self, i: int, text: str, tokens, entries, prompt_logprobs) -> tuple:
        """The prompt put before a completion's text, tokens and logprobs (with `echo`)."""
        if not self.render.echo:
            return text, list(tokens), list(entries)
        prompt = self.render.prompts[i]
        scored = list(prompt_logprobs) if prompt_logprobs else [None] * len(prompt)
        return self.render.texts[i] + text, [*prompt, *tokens], [*scored, *entries]

    def logprobs(self, tokens, entries, offset: int = 0) -> tuple[dict | None, int]:
        if self.render.logprobs is None:
            return None, offset
        if self.chat:
            return self.render.chat(entries), offset
        return self.render.completion(tokens, entries, offset)

    def delta_choice(
        self, index: int, text: str, finish: str | None, first: bool, logprobs=None
    ) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come."""
    if len(streams) == 1:  # the common request: no pump task and second queue per token
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for output in stream:
            await queue.put((i, output))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in streams:
            while True:
                i, output = await queue.get()
                yield i, output
                if output.finished:
                    break
    finally:
        for task in tasks:
            task.cancel()


async def _sse(engine, streams, view: _View, include_usage: bool, count) -> AsyncIterator[str]:
    """The SSE events of a streamed request; `engine` has `abort(request_id)`, and
    `count(outcome)` counts how the HTTP request ended."""
    offsets, totals, prompt_logprobs = {}, {}, {}
    outcome = "disconnected"  # counted once per HTTP request, as for non-streamed ones
    try:
        async for i, output in _merged(streams):
            if output.error:
                outcome = "error"
                yield _event(error_body(output.error, "internal_error"))
                break
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            choices = []
            for delta in output.deltas:
                index = i * view.n + delta.index
                first = index not in offsets
                text, tokens = delta.text, delta.token_ids
                entries = delta.logprobs or [None] * len(tokens)
                if first:
                    text, tokens, entries = view.echoed(
                        i, text, tokens, entries, prompt_logprobs.get(i)
                    )
                logprobs, offsets[index] = view.logprobs(tokens, entries, offsets.get(index, 0))
                choices.append(
                    view.delta_choice(index, text, _finish(delta.finish_reason), first, logprobs)
                )
            if choices:
                yield _event(view.chunk(choices))
            if output.finished:
                totals[i] = (output.prompt_tokens, output.completion_tokens)
        else:
            outcome = "ok"
        if include_usage:
            prompt, completion = (
                (sum(t) for t in zip(*totals.values(), strict=True)) if totals else (0, 0)
            )
            yield _event({**view.chunk([]), "usage": usage(prompt, completion)})
        yield "data: [DONE]\n\n"
    finally:  # client gone or stream done: stop whatever is still generating
        count(outcome)
        for stream in streams:
            engine.abort(stream.request_id)


async def _complete(engine, streams, view: _View, http: Request, count) -> dict:
    """The one JSON answer of a request that is not streamed; `engine` has `abort`,
    `alive` and `_why_stopped()`, `count(outcome)` counts how it ended."""
    gather = asyncio.ensure_future(_collect(streams))
    try:
        while not gather.done():
            await asyncio.wait({gather}, timeout=0.25)
            if not gather.done() and await http.is_disconnected():
                count("disconnected")
                raise APIError(499, "client disconnected", "client_closed_request")
        choices_by_key, prompt_logprobs, totals, error = gather.result()
    finally:
        gather.cancel()
        for stream in streams:
            engine.abort(stream.request_id)
    if error:
        count("error")
        raise APIError(500, error, "internal_error")
    cut = [c for c in choices_by_key.values() if c.finish is None or str(c.finish) == "abort"]
    if cut and not engine.alive:
        # the server shut down under it (SIGTERM past the grace period): not an answer
        count("error")
        raise APIError(503, engine._why_stopped(), "service_unavailable", code="shutting_down")
    count("ok")
    choices = []
    for (i, j), choice in sorted(choices_by_key.items()):
        index = i * view.n + j
        finish = _finish(choice.finish)
        text, tokens, entries = view.echoed(
            i, choice.text, choice.tokens, choice.entries, prompt_logprobs.get(i)
        )
        logprobs, _ = view.logprobs(tokens, entries)
        if view.chat:
            message = {"role": "assistant", "content": text}
            choices.append(
                {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            )
        else:
            choices.append(
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            )
    obj = "chat.completion" if view.chat else "text_completion"
    prompt = sum(t[0] for t in totals.values())
    completion = sum(t[1] for t in totals.values())
    return {
        "id": view.id,
        "object": obj,
        "created": view.created,
        "model": view.model,
        "choices": choices,
        "usage": usage(prompt, completion),
    }


async def _collect(streams):
    choices, prompt_logprobs, totals, error = {}, {}, {}, None
    async for i, output in _merged(streams):
        if output.prompt_logprobs is not None:
            prompt_logprobs[i] = output.prompt_logprobs
        for delta in output.deltas:
            choices.setdefault((i, delta.index), _Choice()).add(delta)
        if output.error:
            error = output.error
        if output.finished:
            totals[i] = (output.prompt_tokens, output.completion_tokens)
    return choices, prompt_logprobs, totals, error


def _finish(reason) -> str | None:
    return None if reason is None else str(reason)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# -- models, prompts --------------------------------------------------------------------


def _model_cards(state: ServerState) -> list[dict]:
    base = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "symbiont",
        "root": state.model_path,
        "parent": None,
    }
    if state.engine is None:
        return [base]
    registry = state.engine.engine.adapters
    cards = [base]
    for name in registry.names():
        info = registry.info(name)
        cards.append({**base, "id": name, "root": info["path"], "parent": state.model_name})
    cache, loaded = _cache(state), set(registry.names())
    for card in cache.cards() if cache is not None else ():
        if card["state"] != AdapterState.FAILED and card["id"] not in loaded:
            root = str(cache.root / card["id"])
            cards.append({**base, "id": card["id"], "root": root, "parent": state.model_name})
    return cards


async def _adapter_cards(state: ServerState) -> list[dict]:
    """Every adapter: loaded by name (pinned in a slot), then the folder's, with tiers."""
    registry = state.ready().engine.adapters
    cards = []
    for name in registry.names():
        info = registry.info(name)
        cards.append(
            {
                "id": name,
                "object": "adapter",
                "source": "loaded",
                "method": info["method"],
                "rank": info["rank"],
                "state": str(AdapterState.RESIDENT),
            }
        )
    await _rescan(state)
    cache, loaded = _cache(state), set(registry.names())
    if cache is not None:
        cards += [card for card in cache.cards() if card["id"] not in loaded]
    return cards


def _cache(state: ServerState):
    """The engine's adapter cache (None without --adapter-dir or while loading)."""
    return None if state.engine is None else state.engine.engine.cache


async def _rescan(state: ServerState) -> None:
    """Pick up adapter folders added since the last scan (file I/O off the event loop)."""
    cache = _cache(state)
    if cache is not None:
        await asyncio.to_thread(cache.scan)


def _adapter_of(state: ServerState, model: str) -> str | None:
    if model == state.model_name:
        return None
    engine = state.ready().engine
    if model in engine.adapters.names():
        return model
    entry = engine.cache.lookup(model) if engine.cache is not None else None
    if entry is None:
        listing = (
            "GET /v1/adapters lists each adapter and its state"
            if engine.cache is not None
            else "start the server with --adapter-dir DIR to serve every adapter folder of DIR"
        )
        raise APIError(
            404,
            f"the model {model!r} does not exist; GET /v1/models lists the base model "
            f"({state.model_name!r}) and the adapters; {listing}",
            "not_found_error",
            "model",
            "model_not_found",
        )
    if entry.state is AdapterState.FAILED:
        raise AdapterFailed(model, entry.reason or "it failed to load")
    return model


def _tokenizer(state: ServerState):
    tokenizer = state.ready().engine.tokenizer
    if tokenizer is None:
        raise APIError(
            400,
            "this model has no tokenizer, so prompts must be lists of token ids",
            *_invalid("prompt"),
        )
    return tokenizer


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # one prompt, as text or token ids
    if not prompt:
        raise APIError(400, "prompt is empty", *_invalid("prompt"))
    return [p if isinstance(p, list) else _tokenizer(state)(p).input_ids for p in prompt]


def _completion_texts(state: ServerState, body: CompletionRequest) -> list[str]:
    """The prompts as text, for `echo`: as sent, or token ids decoded."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    tokenizer = state.ready().engine.tokenizer
    return [p if isinstance(p, str) else _decode(tokenizer, p) for p in prompt]


def _chat_prompt(state: ServerState, body: ChatRequest) -> list[int]:
    return _chat_ids(_tokenizer(state), body.messages, add_generation_prompt=True)


def _chat_ids(
    tokenizer, messages, add_generation_prompt: bool, add_special_tokens: bool = False
) -> list[int]:
    """Token ids of a chat through the tokenizer's template (else `role: content` lines)."""
    messages = [{"role": m.role, "content": m.text()} for m in messages]
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except TemplateError as err:  # the model's own template refuses this chat (e.g. a role)
        raise APIError(
            400,
            f"this model's chat template refuses these messages: {err.message}",
            *_invalid("messages"),
        ) from None
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    """vLLM's /tokenize: text (or a chat) -> token ids, their count, the context length."""
    engine = state.ready()
    if body.model is not None:
        _adapter_of(state, body.model)  # 404 for a name that is not served
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400,
            "send either `prompt` (text) or `messages` (a chat), exactly one of them",
            *_invalid("prompt"),
        )
    tokenizer = _tokenizer(state)
    if body.messages is not None:
        special = bool(body.add_special_tokens)  # a chat template adds its own by default
        ids = _chat_ids(tokenizer, body.messages, body.add_generation_prompt, special)
    else:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer(body.prompt, add_special_tokens=special).input_ids
    out = {"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def _detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    """vLLM's /detokenize: token ids -> text (special tokens kept)."""
    state.ready()
    if body.model is not None:
        _adapter_of(state, body.model)
    tokenizer = _tokenizer(state)
    size = len(tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < size]
    if bad:
        raise APIError(
            400,
            f"tokens: ids must be in [0, {size}) (this tokenizer's vocabulary); got {bad[0]}",
            *_invalid("tokens"),
        )
    return {"prompt": tokenizer.decode(body.tokens)}


# -- errors and auth --------------------------------------------------------------------


def _invalid(param: str) -> tuple[str, str]:
    return "invalid_request_error", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        if first.get("type") == "json_invalid":
            where = first.get("ctx", {}).get("error", "invalid JSON")
            message = f"the body is not valid JSON ({where}); send one JSON object"
            return APIError(400, message, "invalid_request_error").response()
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, "invalid_request_error", param).response()

    @app.exception_handler(RequestError)
    async def request_error(_, err: RequestError):
        return APIError(400, str(err), "invalid_request_error", err.param).response()

    @app.exception_handler(InvalidSamplingParams)
    async def sampling_error(_, err: InvalidSamplingParams):
        return APIError(400, str(err), "invalid_request_error", err.field).response()

    @app.exception_handler(AdapterError)
    async def adapter_error(_, err: AdapterError):
        return APIError(400, str(err), "invalid_request_error", "path").response()

    @app.exception_handler(AdapterFailed)
    async def adapter_failed(_, err: AdapterFailed):
        return APIError(
            400, str(err), "invalid_request_error", "model", "adapter_failed"
        ).response()

    @app.exception_handler(AdapterNotFound)
    async def adapter_not_found(_, err: AdapterNotFound):
        return APIError(404, str(err), "not_found_error", "model", "adapter_not_found").response()

    @app.exception_handler(QueueFull)
    async def queue_full(_, err: QueueFull):
        return APIError(429, str(err), "rate_limit_error", code="queue_full").response()

    @app.exception_handler(EngineStopped)
    async def engine_stopped(_, err: EngineStopped):
        return APIError(503, str(err), "service_unavailable", code="failed").response()

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        message = str(err.detail)
        if err.status_code == 400 and message == "There was an error parsing the body":
            message = (
                "the body could not be parsed as JSON (malformed, or nested deeper than a "
                "request can be); send one JSON object"
            )
        return APIError(err.status_code, message, "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def internal_error(_, err: Exception):  # a bug: still answered in OpenAI's shape
        log.exception("request failed")
        message = f"internal error ({type(err).__name__}); see the server log"
        return APIError(500, message, "internal_error").response()


def _check_text(body: BaseModel) -> None:
    """400 naming the field if any text holds a lone UTF-16 surrogate (JSON allows the
    escape "\\ud800"; no tokenizer or UTF-8 response can carry it)."""
    bad = _surrogate_path(body.model_dump(), ())
    if bad is not None:
        raise APIError(
            400,
            f"{'.'.join(map(str, bad))}: text holds a lone UTF-16 surrogate (an unpaired "
            "\\ud800-\\udfff escape); send valid Unicode",
            *_invalid(str(bad[0])),
        )


def _check_token_ids(state: ServerState, prompts: list[list[int]]) -> None:
    """400 for a token id outside the vocabulary, before anything decodes it."""
    vocab = state.ready().engine.runner.vocab_size
    if any(i < 0 or i >= vocab for prompt in prompts for i in prompt):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", *_invalid("prompt"))


def _surrogate_path(value, path: tuple) -> tuple | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if not isinstance(value, dict | list | tuple):
        return None
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        found = _surrogate_path(item, (*path, key))
        if found is not None:
            return found
    return None


def _adapter_path(root: str | None, given: str) -> str:
    """The folder `given` names, only if it lies under `root` (symlinks and `..` resolved
    first). Refusals read the same whether or not the path exists."""
    if root is None:
        raise APIError(
            403,
            "loading adapters by path is off on this server; start it with --adapter-dir DIR "
            "to allow loads from folders under DIR (or load adapters at start with --adapter)",
            "permission_error",
            "path",
            "adapter_dir_not_set",
        )
    if "\x00" in given:  # no file system path holds one; realpath would raise
        raise APIError(
            400,
            "path: contains a NUL character; pass the adapter folder's path, absolute or "
            "relative to the server's adapter folder",
            "invalid_request_error",
            "path",
        )
    real_root = os.path.realpath(root)
    resolved = os.path.realpath(os.path.join(real_root, given))  # absolute `given` wins
    if os.path.commonpath([real_root, resolved]) != real_root or resolved == real_root:
        raise APIError(
            403,
            f"adapters may be loaded only from folders under the server's adapter folder "
            f"({root}); pass a path inside it, absolute or relative to it",
            "permission_error",
            "path",
            "adapter_path_forbidden",
        )
    return resolved


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read.

    A declared Content-Length over the limit is refused at once; otherwise the body is
    read chunk by chunk (so chunked uploads count too) and refused as soon as it passes
    the limit, then replayed to the app. At most `max_bytes` are ever held."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the request body is larger than this server accepts ({self.max_bytes} bytes); "
            "send a smaller one, or start the server with a larger --max-request-bytes"
        )
        response = APIError(413, message, "invalid_request_error", code="request_too_large")
        response = response.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _needs_key(path: str) -> bool:
    """Every route that reads the model or its tokenizer; /health and /metrics stay open
    for probes and scrapers."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def _install_auth(app: FastAPI, state: ServerState) -> None:
    if not state.api_key:
        return
    expected = f"Bearer {state.api_key}".encode()

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        # Headers arrive as latin-1 text; compared as bytes, in constant time.
        given = request.headers.get("authorization", "").encode("latin-1")
        if _needs_key(request.url.path) and not hmac.compare_digest(given, expected):
            return APIError(
                401,
                "missing or wrong API key; send `Authorization: Bearer <key>`",
                "authentication_error",
                code="invalid_api_key",
            ).response()
        return await call_next(request)
