"""How engine outputs become OpenAI responses, shared by both processes of `symbiont serve`.

`api.py` (the engine's process) and `front.py` (the API process, unless `--no-api-process`) show
a request's outputs with the same code: `View` and `Render` (choices, log-probabilities,
echo), `sse_events` (streamed) and `complete_response` (one JSON answer). The API
process has no tokenizer (loading one imports torch and
transformers); `TokenNames` then stands in for it, filled with the token strings the
engine's process sends (`token_names`). Also here: `APIError`, the `BodyLimit` middleware
and `warm_imports_at_startup`. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from symbiont.decoding import token_bytes
from symbiont.serve.http.protocol import error_body, usage
from symbiont.serve.sequence import RequestOutput
from symbiont.serve.stream import RequestStream


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param=None, code=None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self) -> JSONResponse:
        body = error_body(str(self), self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


def clamp(logprob: float) -> float:
    """JSON has no -inf or NaN: a token the model rules out shows -9999.0, as in vLLM."""
    return max(logprob, -9999.0) if logprob == logprob else -9999.0


@dataclass(frozen=True)
class Render:
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
            relayed = getattr(self.tokenizer, "raw_bytes", None)  # TokenNames
            raw = relayed(token_id) if relayed else token_bytes(self.tokenizer, token_id)
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
            values.append(clamp(entry.logprob))
            top = {self.token(t): clamp(v) for t, v in entry.top}
            top.setdefault(name, clamp(entry.logprob))
            tops.append(top)
        body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
        return {**body, "text_offset": offsets}, offset

    def chat(self, entries) -> dict:
        return {"content": [self._chat_entry(e) for e in entries]}

    def _chat_entry(self, entry) -> dict:
        name = self.token(entry.token_id)
        top = [
            {"token": self.token(t), "logprob": clamp(v), "bytes": self.bytes_of(t)}
            for t, v in entry.top
        ]
        return {
            "token": name,
            "logprob": clamp(entry.logprob),
            "bytes": self.bytes_of(entry.token_id),
            "top_logprobs": top,
        }


class Choice:
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
class View:
    """How engine outputs are shown: ids, object names, choice numbering, logprobs."""

    id: str
    model: str
    chat: bool
    n: int
    created: int
    render: Render

    def spec(self, request_ids: list[str], stream: bool, include_usage: bool) -> dict:
        """Everything another process needs to show this request's outputs as this one
        would (the API process; `from_spec` reads it back)."""
        render = self.render
        table = describe(render.tokenizer)
        if table is not None and render.echo and render.logprobs is not None:
            table["names"] = token_names(render.tokenizer, [t for p in render.prompts for t in p])
        return {
            "tokenizer": table,
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
    def from_spec(cls, spec: dict, tokenizer) -> View:
        as_ids, logprobs, echo, prompts, texts = spec["render"]
        render = Render(
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


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def sse_events(engine, streams, view: View, include_usage: bool, count) -> AsyncIterator[str]:
    """The SSE events of a streamed request; `engine` has `abort(request_id)`, and
    `count(outcome)` counts how the HTTP request ended."""
    offsets, totals, prompt_logprobs, finished = {}, {}, {}, {}
    outcome = "disconnected"  # counted once per HTTP request, as for non-streamed ones
    try:
        async for i, output in merged(streams):
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
                if delta.finish_reason is not None:
                    finished[index] = _finish(delta.finish_reason)
                choices.append(
                    view.delta_choice(index, text, _finish(delta.finish_reason), first, logprobs)
                )
            if choices:
                yield _event(view.chunk(choices))
            if output.finished:
                totals[i] = (output.prompt_tokens, output.completion_tokens)
        else:
            outcome = "ok"
        if outcome == "ok" and _cut_by_shutdown(engine, finished, len(streams) * view.n):
            # the server stopped under it: an error event, not a [DONE] that would make
            # the text so far look like the whole answer
            outcome = "error"
            body = error_body(engine._why_stopped(), "service_unavailable", code="shutting_down")
            yield _event(body)
            return
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


def _cut_by_shutdown(engine, finished: dict[int, str], choices: int) -> bool:
    """Whether some choice of a stream that ended was cut off by the server stopping."""
    cut = len(finished) < choices or "abort" in finished.values()
    return cut and not engine.alive


async def complete_response(engine, streams, view: View, http: Request, count) -> dict:
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
    async for i, output in merged(streams):
        if output.prompt_logprobs is not None:
            prompt_logprobs[i] = output.prompt_logprobs
        for delta in output.deltas:
            choices.setdefault((i, delta.index), Choice()).add(delta)
        if output.error:
            error = output.error
        if output.finished:
            totals[i] = (output.prompt_tokens, output.completion_tokens)
    return choices, prompt_logprobs, totals, error


def _finish(reason) -> str | None:
    return None if reason is None else str(reason)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read.

    A declared Content-Length over the limit is refused without keeping the body;
    otherwise the body is read chunk by chunk (so chunked uploads count too) and refused
    as soon as it passes the limit, then replayed to the app. At most `max_bytes` are ever
    held. A body at most twice the limit is read to its end and dropped before the
    refusal (for at most `DRAIN_S`): closing a connection with unread bytes resets it, and
    a client still sending (asyncio clients do) then got a connection error instead of
    the 413. Larger bodies, and those of clients waiting for "100 Continue", are refused
    at once, unread."""

    DRAIN_S = 5.0

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            # a client that waits for "100 Continue" (curl's large uploads) sent nothing yet:
            # no reset to avoid, and reading would ask it for the whole body
            waits = headers.get(b"expect", b"").lower() == b"100-continue"
            drain = declared.isdigit() and int(declared) <= 2 * self.max_bytes and not waits
            return await self._refuse(scope, receive, send, more=drain)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                more = message.get("more_body", False)
                return await self._refuse(scope, receive, send, more, read=size)
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

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, more: bool, read: int = 0
    ) -> None:
        if more and not await self._drained(receive, 2 * self.max_bytes - read):
            return  # the client left
        message = (
            f"the request body is larger than this server accepts ({self.max_bytes} bytes); "
            "send a smaller one, or start the server with a larger --max-request-bytes"
        )
        response = APIError(413, message, "invalid_request_error", code="request_too_large")
        response = response.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def _drained(self, receive: Receive, at_most: int) -> bool:
        """Read and drop the rest of a refused body, up to `at_most` bytes; False if the
        client left."""
        dropped = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.DRAIN_S):
                while dropped < at_most:
                    message = await receive()
                    if message["type"] != "http.request":
                        return False
                    dropped += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        return True


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


class TokenNames:
    """What `Render` asks of a tokenizer, from names the engine's process sent: the
    vocabulary's length, the special ids, each token decoded alone and its raw bytes."""

    def __init__(self):
        self.length = 0
        self.all_special_ids: list[int] = []
        self._names: dict[int, tuple[str, bytes | None]] = {}

    def __len__(self) -> int:
        return self.length

    def update(self, table: dict | None) -> None:
        """`table` as `describe` and `token_names` make it (msgpack or JSON decoded)."""
        if not table:
            return
        if "length" in table:
            self.length = table["length"]
            self.all_special_ids = list(table["special"])
        for token_id, name, raw in table.get("names") or ():
            self._names[token_id] = (name, raw if raw is None else bytes(raw))

    def decode(self, ids: list[int]) -> str:
        (token_id,) = ids  # Render decodes one token at a time
        return self._names[token_id][0]

    def raw_bytes(self, token_id: int) -> bytes | None:
        return self._names[token_id][1]


def describe(tokenizer) -> dict | None:
    """What `TokenNames` needs of `tokenizer` before any token: None without one."""
    if tokenizer is None:
        return None
    special = sorted(getattr(tokenizer, "all_special_ids", ()) or ())
    return {"length": len(tokenizer), "special": special}


def token_names(tokenizer, ids) -> list[list]:
    """[id, string, raw bytes or None] for each of `ids` the tokenizer knows: the token
    decoded alone and its bytes, as `Render` shows them with a tokenizer."""
    if tokenizer is None:
        return []
    known = len(tokenizer)
    names = []
    for t in sorted(set(ids)):
        if t < known:
            raw = token_bytes(tokenizer, t)
            names.append([t, tokenizer.decode([t]), None if raw is None else list(raw)])
    return names
