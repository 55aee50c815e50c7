"""The OpenAI-compatible HTTP API (FastAPI): the `model` field picks the adapter.

`model` equal to the served base name uses no adapter; any loaded adapter's name uses
that adapter, as in vLLM, SGLang and LoRAX, so existing OpenAI clients work unchanged.
Errors are OpenAI-style JSON: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from symbiont.serve.adapters import AdapterError, AdapterNotFound
from symbiont.serve.async_engine import AsyncEngine, RequestStream
from symbiont.serve.engine import RequestError
from symbiont.serve.metrics import ServeMetrics
from symbiont.serve.protocol import (
    AdapterLoad,
    ChatRequest,
    CompletionRequest,
    error_body,
    now,
    usage,
)
from symbiont.serve.scheduler import QueueFull
from symbiont.serve.sequence import Request as EngineRequest
from symbiont.serve.sequence import RequestOutput, SamplingParams

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
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    engine: AsyncEngine | None = None
    load_error: str | None = None

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            why = self.load_error or "the model is still loading; retry shortly"
            raise APIError(503, why, "service_unavailable", code="loading")
        return self.engine


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="symbiont", summary="Many adapters, one frozen base, OpenAI API")
    app.state.serve = state
    _install_error_handlers(app)
    _install_auth(app, state)

    @app.get("/health")
    async def health():
        state.ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": _model_cards(state)}

    @app.post("/v1/adapters")
    async def load_adapter(body: AdapterLoad):
        engine = state.ready()
        if body.name == state.model_name:
            raise APIError(400, "an adapter may not take the base model's name", *_invalid("name"))
        return await engine.load_adapter(body.name, body.path)

    @app.delete("/v1/adapters/{name}")
    async def unload_adapter(name: str):
        await state.ready().unload_adapter(name)
        return {"id": name, "object": "adapter", "deleted": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        prompts = _completion_prompts(state, body)
        return await _serve(state, body, prompts, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        return await _serve(state, body, [_chat_prompt(state, body)], http, chat=True)

    return app


# -- request handling -------------------------------------------------------------------


async def _serve(state: ServerState, body, prompts: list[list[int]], http: Request, chat: bool):
    engine = state.ready()
    adapter = _adapter_of(state, body.model)
    prefix = "chatcmpl" if chat else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    requests = [
        EngineRequest(f"{request_id}-{i}", prompt, adapter, _sampling(engine, body, prompt, chat))
        for i, prompt in enumerate(prompts)
    ]
    streams = await _submit_all(engine, requests)
    view = _View(request_id, body.model, chat, body.n, now())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(engine, streams, view, include_usage, state.metrics)
        return StreamingResponse(events, media_type="text/event-stream")
    return await _complete(engine, streams, view, http, state.metrics)


async def _submit_all(engine: AsyncEngine, requests: list[EngineRequest]) -> list[RequestStream]:
    streams = []
    try:
        for request in requests:
            streams.append(await engine.submit(request))
    except BaseException:
        for stream in streams:
            engine.abort(stream.request_id)
        raise
    return streams


def _sampling(engine: AsyncEngine, body, prompt: list[int], chat: bool) -> SamplingParams:
    max_tokens = body.token_limit() if chat else body.max_tokens
    if max_tokens is None:  # chat default: whatever context is left
        max_tokens = max(1, engine.engine.max_model_len - len(prompt))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        n=body.n,
        stop=body.stops(),
        ignore_eos=body.ignore_eos,
    )


@dataclass(frozen=True)
class _View:
    """How engine outputs are shown: ids, object names, choice numbering."""

    id: str
    model: str
    chat: bool
    n: int
    created: int

    def chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def delta_choice(self, index: int, text: str, finish: str | None, first: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come."""
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


async def _sse(engine, streams, view: _View, include_usage: bool, metrics) -> AsyncIterator[str]:
    started, totals = set(), {}
    try:
        async for i, output in _merged(streams):
            if output.error:
                metrics.requests.labels("error").inc()
                yield _event(error_body(output.error, "internal_error"))
                break
            choices = []
            for delta in output.deltas:
                index = i * view.n + delta.index
                choices.append(
                    view.delta_choice(
                        index, delta.text, _finish(delta.finish_reason), index not in started
                    )
                )
                started.add(index)
            if choices:
                yield _event(view.chunk(choices))
            if output.finished:
                totals[i] = (output.prompt_tokens, output.completion_tokens)
                metrics.requests.labels("ok").inc()
        if include_usage:
            prompt, completion = (
                (sum(t) for t in zip(*totals.values(), strict=True)) if totals else (0, 0)
            )
            yield _event({**view.chunk([]), "usage": usage(prompt, completion)})
        yield "data: [DONE]\n\n"
    finally:  # client gone or stream done: stop whatever is still generating
        for stream in streams:
            engine.abort(stream.request_id)


async def _complete(engine, streams, view: _View, http: Request, metrics) -> dict:
    gather = asyncio.ensure_future(_collect(streams))
    try:
        while not gather.done():
            await asyncio.wait({gather}, timeout=0.25)
            if not gather.done() and await http.is_disconnected():
                metrics.requests.labels("disconnected").inc()
                raise APIError(499, "client disconnected", "client_closed_request")
        texts, finishes, totals, error = gather.result()
    finally:
        gather.cancel()
        for stream in streams:
            engine.abort(stream.request_id)
    if error:
        metrics.requests.labels("error").inc()
        raise APIError(500, error, "internal_error")
    metrics.requests.labels("ok").inc()
    choices = []
    for (i, j), text in sorted(texts.items()):
        index = i * view.n + j
        finish = _finish(finishes.get((i, j)))
        if view.chat:
            message = {"role": "assistant", "content": text}
            choices.append(
                {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
            )
        else:
            choices.append(
                {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
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
    texts, finishes, totals, error = {}, {}, {}, None
    async for i, output in _merged(streams):
        for delta in output.deltas:
            texts[(i, delta.index)] = texts.get((i, delta.index), "") + delta.text
            if delta.finish_reason:
                finishes[(i, delta.index)] = delta.finish_reason
        if output.error:
            error = output.error
        if output.finished:
            totals[i] = (output.prompt_tokens, output.completion_tokens)
    return texts, finishes, totals, error


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
    return cards


def _adapter_of(state: ServerState, model: str) -> str | None:
    if model == state.model_name:
        return None
    if model not in state.ready().engine.adapters.names():
        raise APIError(
            404,
            f"the model {model!r} does not exist; GET /v1/models lists the base model "
            f"({state.model_name!r}) and the loaded adapters",
            "not_found_error",
            "model",
            "model_not_found",
        )
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


def _chat_prompt(state: ServerState, body: ChatRequest) -> list[int]:
    tokenizer = _tokenizer(state)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


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
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return APIError(400, message, "invalid_request_error", param).response()

    @app.exception_handler(RequestError)
    async def request_error(_, err: RequestError):
        return APIError(400, str(err), "invalid_request_error", err.param).response()

    @app.exception_handler(AdapterError)
    async def adapter_error(_, err: AdapterError):
        return APIError(400, str(err), "invalid_request_error", "path").response()

    @app.exception_handler(AdapterNotFound)
    async def adapter_not_found(_, err: AdapterNotFound):
        return APIError(404, str(err), "not_found_error", "model", "adapter_not_found").response()

    @app.exception_handler(QueueFull)
    async def queue_full(_, err: QueueFull):
        return APIError(429, str(err), "rate_limit_error", code="queue_full").response()

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        return APIError(err.status_code, str(err.detail), "invalid_request_error").response()


def _install_auth(app: FastAPI, state: ServerState) -> None:
    if not state.api_key:
        return
    expected = f"Bearer {state.api_key}"

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path.startswith("/v1/") and request.headers.get("authorization") != expected:
            return APIError(
                401,
                "missing or wrong API key; send `Authorization: Bearer <key>`",
                "authentication_error",
                code="invalid_api_key",
            ).response()
        return await call_next(request)
