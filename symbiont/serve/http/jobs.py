"""The fine-tuning jobs API (OpenAI's shapes, so the `openai` package drives it unchanged)
and tenants, mounted on the app of `symbiont/serve/http/api.py` by `mount_jobs`:

    POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET /v1/files/{id}/content
    POST/GET /v1/fine_tuning/jobs, GET /v1/fine_tuning/jobs/{id},
    POST /v1/fine_tuning/jobs/{id}/cancel, GET .../events, GET .../checkpoints

State lives in `symbiont.jobs` (SQLite + files under `--jobs-dir`); the worker thread
trains through the engine's base executor and hands each finished adapter to the engine,
which serves it at once under the job's `fine_tuned_model`.

With `--tenants FILE`, `TenantGate` (outermost middleware) answers every /v1/ request
without a tenant's key with 401, over the tenant's `requests_per_minute` with 429 and
Retry-After, and hides other tenants' fine-tuned models: `/v1/models` leaves them out, and
a request naming one is answered exactly as for a model that does not exist (the app
itself answers it, for a name that cannot exist, and the name is put back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from symbiont.adapters.names import JOB_METHODS
from symbiont.jobs.examples import Tokenizing
from symbiont.jobs.priority import give_inference_priority, model_executor
from symbiont.jobs.runner import JobRunner, Worksite
from symbiont.jobs.store import ACTIVE, JobStore, now
from symbiont.jobs.tenants import (
    DEFAULT_TENANT,
    RateLimiter,
    Tenant,
    authenticate,
    load_tenants,
    retry_after,
)
from symbiont.jobs.validation import FILE_PURPOSE, JobsError, job_spec, parse_training_file
from symbiont.serve.http.protocol import error_body

log = logging.getLogger(__name__)

MAX_LIST = 10_000
RESTORE_WAIT_S = 30.0  # longest a request waits for finished models to be served again
JOB_RETRY_AFTER_S = 30  # a guess at when a running job may end; clients poll again then
# Routes whose JSON body names a model (a foreign fine-tuned model must look nonexistent).
MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


# Request bodies as the OpenAPI schema shows them (the routes read and check them by hand,
# so that each refusal names its field the way docs/jobs.md says).
_HYPER = {
    "type": "object",
    "properties": {
        "n_epochs": {"anyOf": [{"const": "auto"}, {"type": "integer"}]},
        "batch_size": {"anyOf": [{"const": "auto"}, {"type": "integer"}]},
        "learning_rate_multiplier": {"anyOf": [{"const": "auto"}, {"type": "number"}]},
    },
}
JOB_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model", "training_file"],
                    "properties": {
                        "model": {"type": "string"},
                        "training_file": {"type": "string"},
                        "validation_file": {"type": ["string", "null"]},
                        "suffix": {"type": ["string", "null"]},
                        "seed": {"type": ["integer", "null"]},
                        "hyperparameters": _HYPER,
                        "method": {"type": "object"},
                        "metadata": {"type": ["object", "null"]},
                        "checkpoint_every": {"type": "integer"},
                        "window_positions": {"type": "integer"},
                        "peft": {
                            "type": "object",
                            "properties": {
                                "method": {"enum": list(JOB_METHODS)},
                                "r": {"type": "integer"},
                                "alpha": {"type": "number"},
                                "dropout": {"type": "number"},
                                "target_modules": {
                                    "anyOf": [
                                        {"const": "all-linear"},
                                        {"type": "array", "items": {"type": "string"}},
                                    ]
                                },
                            },
                        },
                    },
                }
            }
        },
    }
}
UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"const": "fine-tune"},
                    },
                }
            }
        },
    }
}


class JobsService:
    """Everything the jobs API holds: store, worker, tenants, rate limits."""

    def __init__(self, state, jobs_dir: str | None, tenants_file: str | None):
        self.state = state  # api.ServerState
        self.tenants: dict[str, Tenant] | None = (
            load_tenants(tenants_file) if tenants_file else None
        )
        self.store = JobStore(jobs_dir) if jobs_dir else None
        self.runner = JobRunner(self.store) if self.store else None
        self.limiter = RateLimiter()
        self.site: Worksite | None = None
        self.unavailable: str | None = None  # why jobs cannot run on this server, if so
        self._own_executor = None  # a connection opened for the worker, closed at stop
        self._stopping = threading.Event()
        self._attacher = threading.Thread(target=self._attach, name="symbiont-jobs-attach")
        self._attacher.daemon = True

    def start(self) -> None:
        if self.runner is not None:
            self.runner.start()
            self._attacher.start()

    def stop(self) -> None:
        self._stopping.set()
        if self.runner is not None:
            self.runner.stop()
            self.store.close()
        if self._own_executor is not None:
            self._own_executor.close()

    def _attach(self) -> None:
        """Once the engine has loaded: give inference priority on the executor, open what
        the worker needs, and let it run."""
        while self.state.engine is None:
            if self._stopping.wait(0.05):
                return
        try:
            self._open_site()
        except Exception as err:  # noqa: BLE001 - reported to every job request, not lost
            self.unavailable = f"the fine-tuning worker could not start ({err})"
            log.error("%s", self.unavailable, exc_info=err)
            self.runner.republished.set()

    def _open_site(self) -> None:
        from symbiont.tenant import load_tokenizer

        engine = self.state.engine.engine
        gate = self.runner.gate
        give_inference_priority(engine.model, gate)
        tokenizer = load_tokenizer(self.state.model_path, required=False)
        if tokenizer is None:
            self.unavailable = "the base model has no tokenizer, so it cannot be fine-tuned here"
            log.error("%s", self.unavailable)
            self.runner.republished.set()  # nothing to restore: no job could have run
            return
        if engine.config.slo_tpot_s is not None:  # FlexLLM's co-serving (jobs/coserve.py)
            from symbiont.jobs.coserve import CoServe

            self.runner.coserve = CoServe(engine.config.slo_tpot_s)
            engine.iteration_hook = self.runner.coserve.after_iteration
        executor = model_executor(engine.model)
        training = _training_executor(executor, self.state.model_path)
        self._own_executor = training if training is not executor else None
        gate.share(training is executor)
        self.site = Worksite(
            model_dir=self.state.model_path,
            base_name=self.state.model_name,
            executor=training,
            tokenizing=Tokenizing(tokenizer, engine.max_model_len),
            publish=self._publish,
            unpublish=self._unpublish,
        )
        self.runner.attach(self.site)

    def _publish(self, name: str, folder: str) -> None:
        """From the worker thread: load the adapter into the engine (on its thread)."""
        asyncio.run(self.state.engine.load_adapter(name, folder))

    def _unpublish(self, name: str) -> None:
        asyncio.run(self.state.engine.unload_adapter(name))

    # -- helpers for the routes -------------------------------------------------------

    def jobs(self) -> JobStore:
        if self.store is None:
            raise JobsError(
                404,
                "fine-tuning is off on this server; start it with --jobs-dir DIR",
                None,
                "jobs_disabled",
            )
        return self.store

    def ready_site(self) -> Worksite:
        self.state.ready()  # 503 while the model loads
        if self.unavailable is not None:
            raise JobsError(503, self.unavailable, "model", "jobs_unavailable")
        if self.site is None:
            raise JobsError(
                503, "the jobs worker is starting; retry shortly", None, "loading", retry_after=1
            )
        return self.site

    def owner(self, model: str) -> str | None:
        return None if self.store is None else self.store.model_owner(model)


def _training_executor(executor, model_path: str):
    """The executor fine-tuning calls go to: a connection of its own to the same
    `serve-base` when the engine reaches one by plain URL (so that the base batches both
    streams of calls); else the engine's own executor object (in-process, or masked),
    whose calls the gate then serializes."""
    url = getattr(executor, "url", None)
    if url is None:
        return executor
    from symbiont.tenant import open_executor

    token = getattr(getattr(executor, "config", None), "token", None)  # the engine's own
    return open_executor(model_path, url, tokens=(token,))


def mount_jobs(app: FastAPI, state) -> JobsService:
    """Add the jobs routes, the tenant gate (with --tenants) and the worker's lifetime."""
    service = JobsService(state, state.jobs_dir, state.tenants)
    app.state.jobs = service
    app.include_router(_router(service))
    app.add_exception_handler(JobsError, _jobs_error)
    if service.store is not None:
        app.add_middleware(RestoredModels, service=service)
    if service.tenants is not None:
        app.add_middleware(TenantGate, service=service)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(application):
        service.start()
        try:
            async with inner(application) as maybe_state:
                yield maybe_state
        finally:
            await asyncio.to_thread(service.stop)

    app.router.lifespan_context = lifespan
    return service


async def _jobs_error(_, err: JobsError) -> JSONResponse:
    kind = {
        401: "authentication_error",
        404: "not_found_error",
        409: "conflict_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(err.status, "invalid_request_error")
    code = err.code if err.code != "invalid_request_error" else None
    response = JSONResponse(error_body(str(err), kind, err.param, code), status_code=err.status)
    if err.retry_after is not None:
        response.headers["retry-after"] = retry_after(err.retry_after)
    return response


def tenant_of(request: Request) -> str:
    return request.scope.get("state", {}).get("tenant", DEFAULT_TENANT)


def _page(items: list[dict], more: bool) -> dict:
    return {
        "object": "list",
        "data": items,
        "has_more": more,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
    }


def _not_found(kind: str, given: str, param: str | None = None) -> JobsError:
    """The same answer for an id that does not exist and one of another tenant."""
    return JobsError(
        404, f"no {kind} with id {given!r}", param, f"{kind.replace(' ', '_')}_not_found"
    )


def _router(service: JobsService) -> APIRouter:
    router = APIRouter()
    validations: set[asyncio.Task] = set()  # file checks running in threads (kept referenced)
    limit_files = Query(MAX_LIST, ge=1, le=MAX_LIST)
    limit_jobs = Query(20, ge=1, le=MAX_LIST)

    # -- files --------------------------------------------------------------------------

    @router.post("/v1/files", openapi_extra=UPLOAD_SCHEMA)
    async def upload(request: Request):
        store, tenant = service.jobs(), tenant_of(request)
        async with request.form(max_files=1, max_fields=4) as form:
            return await _upload(store, tenant, form, _file_limit(service, tenant))

    @router.get("/v1/files")
    async def list_files(
        request: Request,
        after: str | None = None,
        limit: int = limit_files,
        purpose: str | None = None,
    ):
        files, more = service.jobs().list_files(
            tenant_of(request), after=after, limit=limit, purpose=purpose
        )
        return _page([f.as_openai() for f in files], more)

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        return _file(service, request, file_id).as_openai()

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        record = _file(service, request, file_id)
        content = await asyncio.to_thread(service.store.file_path(record.id).read_bytes)
        return Response(content, media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        store, tenant = service.jobs(), tenant_of(request)
        _file(service, request, file_id)
        using = store.jobs_using_file(tenant, file_id)
        if using:
            raise JobsError(
                409,
                f"file {file_id} is used by the job {using[0]}, which has not finished; "
                "cancel it or wait for it to end, then delete the file",
                "file_id",
                "file_in_use",
            )
        store.delete_file(tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- jobs ---------------------------------------------------------------------------

    @router.post("/v1/fine_tuning/jobs", openapi_extra=JOB_SCHEMA)
    async def create_job(request: Request):
        store, tenant = service.jobs(), tenant_of(request)
        body = await _json_body(request)
        spec = job_spec(body, service.state.model_name)
        site = service.ready_site()
        _check_servable(service, spec)
        _admit_job(service, tenant)
        for param in ("training_file", "validation_file"):
            file_id = getattr(spec, param)
            if file_id is not None:
                record = store.get_file(tenant, file_id)
                if record is None or record.purpose != FILE_PURPOSE:
                    raise _not_found("file", file_id, param)
                content = await asyncio.to_thread(store.file_path(file_id).read_bytes)
                await asyncio.to_thread(site.tokenizing.examples, content, file_id, param)
        events = [("info", f"Validating training file: {spec.training_file}")]
        # Again, with no await before the insert: creates sent at once all passed the first
        # check while their files were read, and the tenant got more jobs than its limit.
        _admit_job(service, tenant)
        job = store.add_job(tenant, spec.as_record(), events, status="validating_files")
        # the stored files are checked again as training will read them, off the event
        # loop; the job shows `validating_files` until then, and `queued` (or `failed`) after
        task = asyncio.create_task(asyncio.to_thread(service.runner.validate, job.id))
        validations.add(task)
        task.add_done_callback(_validation_done)
        return job.as_openai()

    def _validation_done(task: asyncio.Task) -> None:
        validations.discard(task)
        if not task.cancelled() and task.exception() is not None:  # e.g. the store closed
            log.error("checking a job's files failed", exc_info=task.exception())

    @router.get("/v1/fine_tuning/jobs")
    async def list_jobs(request: Request, after: str | None = None, limit: int = limit_jobs):
        jobs, more = service.jobs().list_jobs(tenant_of(request), after=after, limit=limit)
        return _page([j.as_openai() for j in jobs], more)

    @router.get("/v1/fine_tuning/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        return _job(service, request, job_id).as_openai()

    @router.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str, request: Request):
        store = service.jobs()
        job = _job(service, request, job_id)
        cancelled = store.transition(
            job.id,
            "cancelled",
            only_from=ACTIVE,
            event=("info", "Job cancelled"),
            finished_at=now(),
        )
        if not cancelled:  # it ended meanwhile: read what it ended as
            job = _job(service, request, job_id)
            raise JobsError(
                400,
                f"job {job_id} has already {_ended(job.status)}; only jobs that are "
                f"{', '.join(ACTIVE)} can be cancelled",
                "job_id",
                "job_not_cancellable",
            )
        service.runner.cancel(job.id)
        return _job(service, request, job_id).as_openai()

    @router.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def job_events(
        job_id: str, request: Request, after: str | None = None, limit: int = limit_jobs
    ):
        job = _job(service, request, job_id)
        events, more = service.store.list_events(job.id, after=after, limit=limit)
        return _page(events, more)

    @router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def job_checkpoints(
        job_id: str,
        request: Request,
        after: str | None = None,
        limit: int = Query(10, ge=1, le=MAX_LIST),
    ):
        job = _job(service, request, job_id)
        checkpoints, more = service.store.list_checkpoints(job.id, after=after, limit=limit)
        return _page(checkpoints, more)

    return router


async def _upload(store: JobStore, tenant: str, form, limit: int) -> dict:
    """Check and store one uploaded training file (multipart fields `file`, `purpose`)."""
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != FILE_PURPOSE:
        raise JobsError(400, f"purpose: must be {FILE_PURPOSE!r}, got {purpose!r}", "purpose")
    if not isinstance(upload, UploadFile):
        raise JobsError(400, "file: required, as a multipart file field", "file")
    content = await upload.read(limit + 1)
    if len(content) > limit:
        raise JobsError(
            413,
            f"file: larger than this tenant's max_file_bytes ({limit} bytes); split it",
            "file",
            "file_too_large",
        )
    name = upload.filename or "upload.jsonl"
    await asyncio.to_thread(parse_training_file, content, name)
    record = await asyncio.to_thread(store.add_file, tenant, name, purpose, content)
    return record.as_openai()


def _check_slot_for(service: JobsService, engine) -> None:
    """Every adapter slot taken by models loaded by name, plus one per job that will
    publish one (and, with --adapter-dir, one slot the folder's adapters keep)."""
    slots = engine.config.max_adapters
    held = len(engine.adapters.names()) + (engine.cache is not None)
    coming = service.jobs().count_active(None)
    if held + coming + 1 > slots:
        raise JobsError(
            409,
            f"no adapter slot would be free to serve this job's model: {held + coming} of "
            f"--max-loras {slots} are held by served models and jobs that will publish one. "
            "Unload a fine-tuned model of yours (DELETE /v1/adapters/NAME), wait for a job "
            "to end, or ask the operator for a larger --max-loras",
            None,
            "no_adapter_slot",
        )


def _ended(status: str) -> str:
    ended = {"succeeded": "succeeded", "failed": "failed", "cancelled": "been cancelled"}
    return ended.get(status, status)


def _file(service: JobsService, request: Request, file_id: str):
    record = service.jobs().get_file(tenant_of(request), file_id)
    if record is None:
        raise _not_found("file", file_id, "file_id")
    return record


def _job(service: JobsService, request: Request, job_id: str):
    job = service.jobs().get_job(tenant_of(request), job_id)
    if job is None:
        raise _not_found("fine-tuning job", job_id, "job_id")
    return job


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, RecursionError) as err:  # also: ints of over 4300 digits
        raise JobsError(400, f"the body is not valid JSON ({err}); send one JSON object") from None
    if not isinstance(body, dict):
        raise JobsError(400, "the body must be a JSON object")
    return body


def _file_limit(service: JobsService, tenant: str) -> int:
    if service.tenants is None:
        return service.state.max_request_bytes
    return service.tenants[tenant].max_file_bytes


def _admit_job(service: JobsService, tenant: str) -> None:
    """429 when the tenant already has its max_concurrent_jobs queued or running."""
    if service.tenants is None:
        return
    limit = service.tenants[tenant].max_concurrent_jobs
    if service.store.count_active(tenant) >= limit:
        raise JobsError(
            429,
            f"this tenant already has {limit} jobs queued or running (max_concurrent_jobs); "
            "retry when one ends, or cancel one",
            None,
            "too_many_jobs",
            retry_after=JOB_RETRY_AFTER_S,
        )


def _check_servable(service: JobsService, spec) -> None:
    """The adapter the job makes must be one the engine can serve, and have a slot to be
    served in once trained (else the job trained, then failed to publish)."""
    engine = service.state.ready().engine
    _check_slot_for(service, engine)
    peft = spec.peft
    # DoRA is served as a LoRA slot (plus magnitudes), so its rank has LoRA's bound
    if peft["method"] in ("lora", "dora") and peft["r"] > engine.config.max_lora_rank:
        raise JobsError(
            400,
            f"peft.r: {peft['r']} is above this server's max_lora_rank "
            f"({engine.config.max_lora_rank}); choose a rank up to it",
            "peft.r",
        )
    if peft["target"] in (None, "all-linear"):
        return
    output = _name_of(engine.model, engine.model.get_output_embeddings())
    names = [spec.name for spec in model_executor(engine.model).manifest.layers]
    layers = {name.rsplit(".", 1)[-1] for name in names if name != output}
    for target in peft["target"].split(","):
        if target not in layers:
            raise JobsError(
                400,
                f"peft.target_modules: {target!r} is not a servable layer of this model; "
                f"choose among its linear layers, e.g. q_proj, v_proj",
                "peft.target_modules",
            )


def _name_of(model, module) -> str | None:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return None


class RestoredModels:
    """ASGI middleware: after a restart, a request that may name a fine-tuned model waits
    (at most RESTORE_WAIT_S) until the worker has served the finished jobs' models again,
    so a client that sees /health ok finds every model it had before."""

    def __init__(self, app: ASGIApp, service: JobsService):
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        restored = self.service.runner.republished
        path = scope.get("path", "")
        names_models = path in MODEL_ROUTES or path.startswith(("/v1/models", "/v1/adapters"))
        loaded = self.service.state.engine is not None
        if scope["type"] == "http" and names_models and loaded and not restored.is_set():
            await asyncio.to_thread(restored.wait, RESTORE_WAIT_S)
        await self.app(scope, receive, send)


# -- tenants ----------------------------------------------------------------------------


def _needs_tenant(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class TenantGate:
    """ASGI middleware for --tenants: authentication, rate limits, model visibility."""

    def __init__(self, app: ASGIApp, service: JobsService):
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _needs_tenant(scope["path"]):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        tenant = authenticate(
            self.service.tenants, headers.get(b"authorization", b"").decode("latin-1")
        )
        if tenant is None:
            message = "missing or wrong API key; send `Authorization: Bearer <tenant key>`"
            error = error_body(message, "authentication_error", None, "invalid_api_key")
            return await JSONResponse(error, status_code=401)(scope, receive, send)
        wait = self.service.limiter.admit(tenant)
        if wait:
            message = (
                f"over this tenant's requests_per_minute ({tenant.requests_per_minute}); "
                f"retry in {retry_after(wait)} s"
            )
            error = error_body(message, "rate_limit_error", None, "rate_limit_exceeded")
            response = JSONResponse(error, status_code=429)
            response.headers["retry-after"] = retry_after(wait)
            return await response(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant.name
        if scope["path"] in ("/v1/models", "/v1/adapters") and scope["method"] == "GET":
            return await self.app(scope, receive, self._visible_models(tenant.name, send))
        if scope["path"].startswith("/v1/adapters/") and scope["method"] == "DELETE":
            name = scope["path"].removeprefix("/v1/adapters/")
            if self.service.owner(name) not in (None, tenant.name):
                error = error_body(f"no adapter named {name!r} is loaded", "not_found_error",
                                   "model", "adapter_not_found")  # fmt: skip
                return await JSONResponse(error, status_code=404)(scope, receive, send)
        if scope["path"] in MODEL_ROUTES and scope["method"] == "POST":
            return await self._hide_foreign_model(tenant.name, scope, receive, send)
        return await self.app(scope, receive, send)

    def _visible_models(self, tenant: str, send: Send) -> Send:
        """A `send` that drops other tenants' fine-tuned models from the listing."""
        held: list[Message] = []

        async def filtered(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)
                return
            if message["type"] != "http.response.body" or not held:
                return await send(message)
            held.append(message)
            if message.get("more_body"):
                return
            start, *bodies = held
            body = b"".join(m.get("body", b"") for m in bodies)
            if start["status"] == 200:
                listing = json.loads(body)
                listing["data"] = [
                    card for card in listing["data"]
                    if self.service.owner(card["id"]) in (None, tenant)
                ]  # fmt: skip
                body = json.dumps(listing).encode()
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return filtered

    async def _hide_foreign_model(self, tenant: str, scope, receive, send) -> None:
        """A request naming another tenant's model is sent on naming a model that cannot
        exist, and the answer (the app's own 404) gets the name back: so it reads exactly
        as for any model that does not exist, whatever the app's wording."""
        body, replay = await _peek_body(receive, self.service.state.max_request_bytes)
        model = _model_field(body)
        if model is None or self.service.owner(model) in (None, tenant):
            return await self.app(scope, replay, send)
        stand_in = f"symbiont-hidden-{secrets.token_hex(8)}"
        fields = json.loads(body)
        fields["model"] = stand_in
        rewritten = json.dumps(fields).encode()

        async def receive_rewritten() -> Message:
            return {"type": "http.request", "body": rewritten, "more_body": False}

        held: list[Message] = []

        async def send_restored(message: Message) -> None:
            held.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                start, *bodies = held
                out = b"".join(m.get("body", b"") for m in bodies)
                out = out.replace(stand_in.encode(), model.encode())
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(out)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": out, "more_body": False})

        scope = {**scope, "headers": _without_length(scope["headers"], len(rewritten))}
        await self.app(scope, receive_rewritten, send_restored)


async def _peek_body(receive: Receive, limit: int) -> tuple[bytes, Callable]:
    """Read the body (up to `limit` bytes; a bigger one is left for the body limit to
    refuse) and a `receive` that replays it."""
    chunks, size, more = [], 0, True
    while more and size <= limit:
        message = await receive()
        if message["type"] != "http.request":
            chunks.append(None)
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
    queued = [
        {"type": "http.request", "body": c, "more_body": True} for c in chunks if c is not None
    ]
    if queued and not more:
        queued[-1]["more_body"] = False

    async def replay() -> Message:
        if queued:
            return queued.pop(0)
        return await receive()

    whole = b"".join(c for c in chunks if c is not None) if not more else b""
    return whole, replay


def _model_field(body: bytes) -> str | None:
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):  # the app answers it with its own 400
        return None
    model = fields.get("model") if isinstance(fields, dict) else None
    return model if isinstance(model, str) else None


def _without_length(headers, length: int) -> list:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]
