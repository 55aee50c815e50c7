"""The OpenAI-compatible HTTP API (FastAPI): the `model` field picks the adapter.

`model` equal to the served base name uses no adapter; any loaded adapter's name uses
that adapter, as in vLLM, SGLang and LoRAX, so existing OpenAI clients work unchanged.
Errors are OpenAI-style JSON: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from symbiont.decoding import InvalidSamplingParams, SamplingParams
from symbiont.serve.adapter_cache import AdapterFailed, AdapterState
from symbiont.serve.adapters import AdapterError, AdapterNotFound
from symbiont.serve.async_engine import AsyncEngine, EngineStopped
from symbiont.serve.engine import RequestError
from symbiont.serve.http.jobs import mount_jobs, tenant_of
from symbiont.serve.http.metrics import ServeMetrics
from symbiont.serve.http.protocol import (
    AdapterLoad,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    now,
)
from symbiont.serve.http.relay import RELAY_HEADER, SPEC_HEADER, valid_relay_id
from symbiont.serve.http.render import (
    APIError,
    BodyLimit,
    Render,
    View,
    complete_response,
    sse_events,
    warm_imports_at_startup,
)
from symbiont.serve.scheduler import QueueFull
from symbiont.serve.sequence import Request as EngineRequest
from symbiont.serve.stream import RequestStream

log = logging.getLogger(__name__)

# Used when a tokenizer has no chat template of its own.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


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
    relay: object | None = None  # CoreRelay of the API process: outputs go there
    executor: object | None = None  # the engine's; closed at exit (a remote one says bye)
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
    app.add_middleware(CountRefused, metrics=state.metrics)
    _install_auth(app, state)  # outermost: no body is read for an unauthenticated request

    @app.get("/health")
    async def health():  # liveness: a restart cannot bring back a remote serve-base
        state.ready()
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():  # readiness: also whether requests can be served now
        _check_executor(state.ready().engine)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        # 503 while the model loads: a list of the base alone, before --adapter's are
        # loaded, read as "this server has no such adapter"
        state.ready()
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
        folder = _adapter_path(state.adapter_dir, body.path, show_root=state.tenants is None)
        card = await engine.load_adapter(body.name, folder)
        state.loaded_by[body.name] = tenant_of(http)
        if state.tenants is not None:  # the path as the tenant gave it, not the host's
            card = {**card, "path": body.path}
        return card

    @app.delete("/v1/adapters/{name:path}")  # names may hold '/' (org/adapter)
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
    _check_fits_queue(engine, len(prompts), body.n)
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
    view = View(request_id, body.model, chat, body.n, now(), render)
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    if relay_id is not None:  # the API process shows the outputs (front.py)
        try:
            spec = view.spec([r.request_id for r in requests], body.stream, include_usage)
            return JSONResponse(spec, headers={SPEC_HEADER: "1"})
        except BaseException:  # queued, but nobody will read them
            for stream in streams:
                engine.abort(stream.request_id)
            raise
    count = _counter(state.metrics)
    if body.stream:
        events = sse_events(engine, streams, view, include_usage, count)
        return StreamingResponse(events, media_type="text/event-stream")
    return await complete_response(engine, streams, view, http, count)


EXECUTOR_LOST_S = 30.0  # /health reports a lost executor for this long after a failure


def _check_executor(engine) -> None:
    """503 (/ready) while the last iteration failed for want of the base executor, for at
    most EXECUTOR_LOST_S after the last such failure: a readiness probe then stops sending
    traffic that would fail, and without traffic the report expires and lets a request
    try again. The open endpoint names no address: the server log has the executor's."""
    lost = engine.executor_lost
    if lost is None:
        return
    age = time.monotonic() - lost[0]
    if age < EXECUTOR_LOST_S:
        raise APIError(
            503,
            f"the base executor did not answer {age:.0f} s ago; see the server log",
            "service_unavailable",
            code="executor_unavailable",
        )


def _check_fits_queue(engine: AsyncEngine, prompts: int, n: int) -> None:
    """400 for a request of more sequences than the queue holds: a 429 ("retry later")
    could never succeed."""
    limit = engine.engine.config.max_queue
    if prompts * n > limit:
        what = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
        raise APIError(
            400,
            f"{what} asks for {prompts * n} sequences, more than this server queues at once "
            f"(--max-queue {limit}); send fewer prompts per request or lower n",
            *_invalid("prompt" if prompts > 1 else "n"),
        )


class CountRefused:
    """ASGI middleware: a completion refused with a 4xx (bad input, unknown model, full
    queue, too large) counts as a request of outcome "refused"; the others are counted
    where they end ("ok", "error", "disconnected": 499)."""

    ROUTES = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.ROUTES:
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 499:
                self.metrics.requests.labels("refused").inc()
            await send(message)

        await self.app(scope, receive, counting_send)


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
        stop_token_ids=tuple(body.stop_token_ids or ()),
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


def _render(engine: AsyncEngine, body, prompts, texts, chat: bool) -> Render:
    tokenizer = engine.engine.tokenizer
    echo = bool(getattr(body, "echo", False))
    if echo and texts is None:
        texts = [_decode(tokenizer, p) for p in prompts]
    return Render(
        tokenizer,
        body.return_tokens_as_token_ids,
        _asked_logprobs(body, chat),
        echo,
        tuple(tuple(p) for p in prompts),
        tuple(texts or ()),
    )


def _decode(tokenizer, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


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
    registry = state.engine.engine.adapters  # the route answered 503 while it loads
    cards = [base]
    for name in registry.names():
        info = registry.info(name)
        cards.append({**base, "id": name, "root": info["path"], "parent": state.model_name})
    cache, loaded = _cache(state), set(registry.names())
    for card in cache.cards() if cache is not None else ():
        if card["state"] != AdapterState.FAILED and card["id"] not in loaded:
            root = str(cache.root / card["id"])
            cards.append({**base, "id": card["id"], "root": root, "parent": state.model_name})
    if state.tenants is not None:  # tenants see names, not the host's folders
        cards = [{**card, "root": card["id"]} for card in cards]
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
    context = state.ready().engine.max_model_len
    return [p if isinstance(p, list) else _ids(_tokenizer(state), p, context) for p in prompt]


def _ids(tokenizer, text: str, context: int, special: bool = True, param: str = "prompt"):
    """`text`'s token ids, refused (400 naming `param`) if a prefix of it is already past
    the context: a prompt of megabytes otherwise held the tokenizer, and with it the
    GIL of the engine's process, for seconds before the same refusal."""
    limit = 2 * _longest_token(tokenizer) * (context + 1)  # chars of > 2 x context tokens
    if len(text) > limit:
        head = tokenizer(text[:limit], add_special_tokens=special, verbose=False).input_ids
        if len(head) > context + 8:  # (a cut word can tokenize into a few more pieces)
            raise APIError(
                400,
                f"{param}: longer than the model's context of {context} tokens (its first "
                f"{limit} characters alone are {len(head)} tokens); shorten the {param}",
                *_invalid(param),
            )
    return tokenizer(text, add_special_tokens=special, verbose=False).input_ids


@functools.lru_cache(maxsize=4)
def _longest_token(tokenizer) -> int:
    """Characters of the vocabulary's longest token (as the vocabulary spells it: for a
    byte-level BPE its bytes), which bounds the characters one token covers."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def _completion_texts(state: ServerState, body: CompletionRequest) -> list[str]:
    """The prompts as text, for `echo`: as sent, or token ids decoded."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    tokenizer = state.ready().engine.tokenizer
    return [p if isinstance(p, str) else _decode(tokenizer, p) for p in prompt]


def _chat_prompt(state: ServerState, body: ChatRequest) -> list[int]:
    context = state.ready().engine.max_model_len
    return _chat_ids(_tokenizer(state), body.messages, add_generation_prompt=True, context=context)


def _chat_ids(
    tokenizer,
    messages,
    add_generation_prompt: bool,
    add_special_tokens: bool = False,
    context: int | None = None,
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
    if context is not None:
        return _ids(tokenizer, text, context, add_special_tokens, param="messages")
    return tokenizer(text, add_special_tokens=add_special_tokens, verbose=False).input_ids


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
        ids = tokenizer(body.prompt, add_special_tokens=special, verbose=False).input_ids
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
        if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            message = (
                "the body must be one JSON object of the request's fields, sent with "
                "Content-Type: application/json"
            )
        elif param in ONE_OF and _in_union(err.errors(), param):
            message = f"{param}: must be {ONE_OF[param]}"
        else:
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


# Fields of several types: pydantic names each type it tried ("prompt.str: Input should
# be a valid string" for a list of floats); the 400 names them all instead.
ONE_OF = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of "
    "token-id lists",
    "stop": "a string or a list of strings",
}


def _in_union(errors, param: str) -> bool:
    """Whether pydantic's errors for `param` are its tries of each type of a union."""
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    return any(
        len(loc) > 1 and loc[0] == param and loc[1].startswith(("str", "list[")) for loc in locs
    )


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


def _adapter_path(root: str | None, given: str, show_root: bool = True) -> str:
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
            "adapters may be loaded only from folders under the server's adapter folder"
            f"{f' ({root})' if show_root else ''}; pass a path inside it, "
            f"{'absolute or ' if show_root else ''}relative to it",
            "permission_error",
            "path",
            "adapter_path_forbidden",
        )
    return resolved


def _needs_key(path: str) -> bool:
    """Every route that reads the model or its tokenizer; /health and /metrics stay open
    for probes and scrapers."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def _install_auth(app: FastAPI, state: ServerState) -> None:
    if not state.api_key:
        return
    expected = state.api_key.encode()

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        # Headers arrive as latin-1 text; the key is compared as bytes, in constant time,
        # and the scheme without case (RFC 7235), as the --tenants gate does.
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        right = hmac.compare_digest(key.strip().encode("latin-1"), expected)
        if _needs_key(request.url.path) and not (right and scheme.lower() == "bearer"):
            return APIError(
                401,
                "missing or wrong API key; send `Authorization: Bearer <key>`",
                "authentication_error",
                code="invalid_api_key",
            ).response()
        return await call_next(request)
