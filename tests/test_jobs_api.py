"""The fine-tuning jobs API driven by the official `openai` package, with tenants.

One server (tiny Llama, character tokenizer, on 127.0.0.1) serves four tenants; a second
pair of servers on one jobs dir checks restart and exact resume. Trained adapters are
checked against vanilla transformers + peft loading the same folder, and a resumed job's
adapter against an uninterrupted run of the same job, bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from symbiont.client.virt import VirtLayer
from symbiont.jobs.coserve import PLAN_FILE
from symbiont.jobs.priority import InferenceExecutor
from symbiont.jobs.store import JobStore
from symbiont.serve import EngineConfig
from symbiont.serve.config import ServerConfig
from symbiont.serve.http.server import BackgroundServer
from tests.test_serve_common import Reference, add_char_tokenizer

ENGINE = EngineConfig(max_running=8, max_batched_tokens=24, block_size=4, num_blocks=256)
BASE = "tiny-llama"
KEYS = {
    "alice": "alice-key",
    "bob": "bob-key",
    "carol": "carol-key",
    "dave": "dave-key",
    "erin": "erin-key",
}
TENANTS = {
    "alice": {"api_key": KEYS["alice"], "max_file_bytes": 4000},
    "bob": {"api_key": "sha256:" + hashlib.sha256(KEYS["bob"].encode()).hexdigest()},
    "carol": {"api_key": KEYS["carol"], "requests_per_minute": 3},
    "dave": {"api_key": KEYS["dave"], "max_concurrent_jobs": 1},
    "erin": {"api_key": KEYS["erin"], "max_concurrent_jobs": 1},
}
LORA = {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}


def chats(n: int, start: int = 0) -> bytes:
    lines = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}!"}]}
        for i in range(start, start + n)
    ]  # fmt: skip
    return "\n".join(json.dumps(line) for line in lines).encode()


@pytest.fixture(scope="module")
def model_dir(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("jobs-model") / BASE
    shutil.copytree(checkpoints("llama"), folder)
    return add_char_tokenizer(folder)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs-server")
    (root / "tenants.json").write_text(json.dumps(TENANTS))
    config = ServerConfig(
        model=str(model_dir),
        port=0,
        engine=ENGINE,
        jobs_dir=str(root / "jobs"),
        tenants=str(root / "tenants.json"),
    )
    with BackgroundServer(config) as running:
        yield running


def client(server, tenant: str | None) -> openai.OpenAI:
    key = KEYS[tenant] if tenant else "none"
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def alice(server):
    return client(server, "alice")


@pytest.fixture(scope="module")
def bob(server):
    return client(server, "bob")


def runner_of(server):
    return server._server.config.app.state.jobs.runner


def run_dir(server, job_id: str):
    return server._server.config.app.state.jobs.store.run_dir(job_id)


def wait_for(api: openai.OpenAI, job_id: str, statuses=("succeeded", "failed", "cancelled")):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = api.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {job.status}")


def refused(call, *args, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call(*args, **kwargs)
    return caught.value


def upload(api: openai.OpenAI, content: bytes, name: str = "train.jsonl"):
    return api.files.create(file=(name, content), purpose="fine-tune")


def create(api, training_file, **kw):
    """A job; while a freshly started server's jobs worker is still starting (503 `loading`,
    with Retry-After), asks again, as a client honouring Retry-After does."""
    kw.setdefault("hyperparameters", {"n_epochs": 1, "batch_size": 2})
    extra = {"peft": kw.pop("peft", LORA), **kw.pop("extra", {})}
    deadline = time.monotonic() + 120
    while True:
        try:
            return api.fine_tuning.jobs.create(
                model=BASE, training_file=training_file, extra_body=extra, **kw
            )
        except openai.InternalServerError as err:
            starting = err.status_code == 503 and err.code == "loading"
            if not starting or time.monotonic() > deadline:
                raise
            assert err.response.headers["retry-after"] == "1"
            time.sleep(0.2)


def greedy(api, model: str, prompt: str, n: int = 6) -> str:
    return (
        api.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
        .choices[0]
        .text
    )


def reference_text(model_dir, adapters: dict, adapter: str | None, prompt: str, n: int = 6):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = Reference(model_dir, adapters).generate(tokenizer(prompt).input_ids, adapter, n)
    return tokenizer.decode(ids, skip_special_tokens=True)


# -- the main path ----------------------------------------------------------------------


def test_upload_train_watch_and_serve(server, alice, bob, model_dir):
    train = upload(alice, chats(6))
    valid = upload(alice, chats(2, start=10), "valid.jsonl")
    assert (train.object, train.purpose, train.bytes) == ("file", "fine-tune", len(chats(6)))
    assert alice.files.content(train.id).content == chats(6)
    job = create(
        alice,
        train.id,
        validation_file=valid.id,
        suffix="greeter",
        hyperparameters={"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 5},
        extra={"checkpoint_every": 2},
    )
    assert job.status == "validating_files" and job.organization_id == "alice"
    # the settings as a request writes them, with the alpha it trains with (2r): it
    # showed `alpha: None` and `target`
    assert job.model_extra["peft"] == {**LORA, "alpha": 8, "dropout": 0.0}
    job = wait_for(alice, job.id)
    assert job.status == "succeeded", job.error
    assert "greeter" in job.fine_tuned_model and job.fine_tuned_model.startswith(f"ft:{BASE}:")
    assert job.trained_tokens > 0 and job.finished_at >= job.created_at
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 2

    events = list(alice.fine_tuning.jobs.list_events(job.id, limit=100))
    messages = [e.message for e in events]
    assert messages[-1].startswith("Validating training file")  # newest first
    assert messages[-2] == "Files validated (6 training examples); queued"
    assert messages[0].startswith("The job has successfully completed")
    metrics = [e.data for e in events if e.type == "metrics"]
    assert sorted(m["step"] for m in metrics) == [1, 2, 3, 4, 5, 6]
    assert "valid_loss" in next(m for m in metrics if m["step"] == 6)
    steps = [c.step_number for c in alice.fine_tuning.jobs.checkpoints.list(job.id)]
    assert steps == [6, 4, 2]
    results = alice.files.content(job.result_files[0]).text.splitlines()
    assert results[0].startswith("step,train_loss,valid_loss") and len(results) == 7

    # served at once, to its tenant only, exactly as vanilla peft loads the same adapter
    assert job.fine_tuned_model in [m.id for m in alice.models.list()]
    assert job.fine_tuned_model not in [m.id for m in bob.models.list()]
    # a tenant sees names, not the host's folders (the base's or the runs')
    assert all(m.model_extra["root"] == m.id for m in alice.models.list())
    folder = run_dir(server, job.id)
    for prompt in ("hi 3", "hello"):
        want = reference_text(model_dir, {"ft": folder}, "ft", prompt)
        assert greedy(alice, job.fine_tuned_model, prompt) == want
    chat = alice.chat.completions.create(
        model=job.fine_tuned_model, messages=[{"role": "user", "content": "hi 1"}], max_tokens=4
    )
    assert chat.model == job.fine_tuned_model and chat.choices[0].message.content is not None
    # /metrics is open to anyone: it counts fine-tuned models without naming them
    exposed = httpx.get(str(alice.base_url).replace("/v1/", "/metrics")).text
    assert "ft:" not in exposed and 'adapter="(fine-tuned)"' in exposed


def test_other_tenants_see_nothing(server, alice, bob, model_dir):
    mine = upload(alice, chats(2))
    job = wait_for(alice, create(alice, mine.id, peft={"method": "ia3"}).id)  # IA3 this time
    assert job.status == "succeeded", job.error
    want = reference_text(model_dir, {"ft": run_dir(server, job.id)}, "ft", "hi 1")
    assert greedy(alice, job.fine_tuned_model, "hi 1") == want

    def same_as_missing(call, real: str, fake: str):
        foreign, missing = refused(call, real), refused(call, fake)
        assert foreign.status_code == missing.status_code == 404
        assert foreign.body == json.loads(json.dumps(missing.body).replace(fake, real))

    same_as_missing(bob.files.retrieve, mine.id, "file-0123")
    same_as_missing(bob.files.content, mine.id, "file-0123")
    same_as_missing(bob.files.delete, mine.id, "file-0123")
    same_as_missing(bob.fine_tuning.jobs.retrieve, job.id, "ftjob-0123")
    same_as_missing(bob.fine_tuning.jobs.cancel, job.id, "ftjob-0123")
    same_as_missing(lambda j: list(bob.fine_tuning.jobs.list_events(j)), job.id, "ftjob-0123")
    same_as_missing(lambda j: list(bob.fine_tuning.jobs.checkpoints.list(j)), job.id, "ftjob-0123")
    model = job.fine_tuned_model
    same_as_missing(lambda m: greedy(bob, m, "hi"), model, "ft:nobody:x")
    same_as_missing(
        lambda m: bob.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}]),
        model,
        "ft:nobody:x",
    )

    def tokenize(key: str, name: str) -> httpx.Response:
        body = {"model": name, "prompt": "hi"}
        return httpx.post(
            f"{server.url}/tokenize", json=body, headers={"Authorization": f"Bearer {key}"}
        )

    assert tokenize(KEYS["alice"], model).status_code == 200
    foreign, missing = tokenize(KEYS["bob"], model), tokenize(KEYS["bob"], "ft:nobody:x")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json() == json.loads(missing.text.replace("ft:nobody:x", model))

    def adapters(key: str) -> list[str]:
        headers = {"Authorization": f"Bearer {key}"}
        return [
            a["id"] for a in httpx.get(f"{server.url}/v1/adapters", headers=headers).json()["data"]
        ]

    assert model in adapters(KEYS["alice"]) and model not in adapters(KEYS["bob"])
    assert mine.id not in [f.id for f in bob.files.list()]
    assert job.id not in [j.id for j in bob.fine_tuning.jobs.list()]
    # a page after another tenant's id reads as one after an id that does not exist
    assert [f.id for f in bob.files.list(after=mine.id)] == []
    assert [j.id for j in bob.fine_tuning.jobs.list(after=job.id)] == []
    err = refused(create, bob, mine.id)  # a foreign file id, as a missing one
    assert (err.status_code, err.param) == (404, "training_file")
    assert err.body == refused(create, bob, "file-0123").body | {"message": err.body["message"]}
    assert err.message.endswith(f"no file with id '{mine.id}'")


@pytest.mark.parametrize("method", ["dora", "loha", "lokr", "vera"])
def test_every_job_method_trains_and_serves_as_vanilla_peft(server, alice, model_dir, method):
    """Jobs train each weight method the engine batches; the result serves as peft loads it."""
    mine = upload(alice, chats(2))
    peft = {"method": method, "r": 4, "target_modules": ["q_proj", "v_proj"]}
    job = wait_for(alice, create(alice, mine.id, peft=peft, suffix=method).id)
    assert job.status == "succeeded", job.error
    config = json.loads((run_dir(server, job.id) / "adapter_config.json").read_text())
    assert (config["peft_type"], config.get("use_dora", False)) == (
        ("LORA", True) if method == "dora" else (method.upper(), False)
    )
    want = reference_text(model_dir, {"ft": run_dir(server, job.id)}, "ft", "hi 2")
    assert greedy(alice, job.fine_tuned_model, "hi 2") == want


def test_keys_and_rate_limits(server):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/v1/files", "/v1/fine_tuning/jobs"):
            response = httpx.get(server.url + path, headers=headers)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    carol = client(server, "carol")  # 3 requests per minute
    for _ in range(3):
        carol.models.list()
    err = refused(carol.models.list)
    assert err.status_code == 429 and "requests_per_minute (3)" in err.message
    assert 1 <= int(err.response.headers["retry-after"]) <= 60


def test_cancel_while_the_base_keeps_answering(server, model_dir):
    dave = client(server, "dave")  # one job at a time
    long = create(
        dave, upload(dave, chats(8)).id, hyperparameters={"n_epochs": 50, "batch_size": 1}
    )
    wait_for(dave, long.id, ("running",))
    err = refused(create, dave, upload(dave, chats(2)).id)
    assert err.status_code == 429 and "max_concurrent_jobs" in err.message
    assert int(err.response.headers["retry-after"]) >= 1
    # inference goes on while the job trains, its base-layer calls ahead of the job's
    engine = server.state.engine.engine
    assert all(
        isinstance(m.executor, InferenceExecutor)
        for m in engine.model.modules()
        if isinstance(m, VirtLayer)
    )
    assert greedy(dave, BASE, "hi 2") == reference_text(model_dir, {}, None, "hi 2")
    started = time.monotonic()
    cancelled = dave.fine_tuning.jobs.cancel(long.id)
    assert cancelled.status == "cancelled"
    runner = runner_of(server)
    while runner.current == long.id:
        time.sleep(0.01)
    assert time.monotonic() - started < 5, "the worker kept training a cancelled job"
    assert "Job cancelled" in [e.message for e in dave.fine_tuning.jobs.list_events(long.id)]
    assert dave.fine_tuning.jobs.retrieve(long.id).status == "cancelled"
    err = refused(dave.fine_tuning.jobs.cancel, long.id)
    assert err.status_code == 400 and "already been cancelled" in err.message
    again = create(dave, upload(dave, chats(2)).id)  # admitted again
    dave.fine_tuning.jobs.cancel(again.id)


def test_a_failing_job_ends_failed_and_the_rest_go_on(server, bob, model_dir):
    blocker = create(
        bob, upload(bob, chats(8)).id, hyperparameters={"n_epochs": 50, "batch_size": 1}
    )
    doomed_file = upload(bob, chats(3))
    doomed = create(bob, doomed_file.id)
    # the stored file vanishes behind the API's back (disk trouble) before the job runs
    server._server.config.app.state.jobs.store.file_path(doomed_file.id).unlink()
    bob.fine_tuning.jobs.cancel(blocker.id)
    job = wait_for(bob, doomed.id)
    assert job.status == "failed"
    assert job.error.code == "invalid_training_file" and job.error.param == "training_file"
    assert "is gone" in job.error.message
    event = next(iter(bob.fine_tuning.jobs.list_events(job.id)))
    assert event.level == "error" and "The job failed" in event.message
    after = wait_for(bob, create(bob, upload(bob, chats(2)).id).id)
    assert after.status == "succeeded"
    assert greedy(bob, BASE, "hi 2") == reference_text(model_dir, {}, None, "hi 2")


def test_a_file_that_fails_its_check_at_run_time_fails_the_job(server, bob):
    """The job shows `validating_files` while its stored file is checked as training will
    read it; a copy that went bad after creation fails the job with an error and an event."""
    jobs = server._server.config.app.state.jobs
    data = upload(bob, chats(2))
    seen = []

    def spoil(job_id: str) -> None:  # the stored copy goes bad behind the API's back
        seen.append(jobs.store.get_job(None, job_id).status)
        jobs.store.file_path(data.id).write_bytes(b'{"prompt": "hi", "completion": ""}\n')

    jobs.runner.validation_hook = spoil
    try:
        created = create(bob, data.id)
        job = wait_for(bob, created.id)
    finally:
        jobs.runner.validation_hook = None
    assert created.status == "validating_files" and seen == ["validating_files"]
    assert job.status == "failed" and job.finished_at is not None
    assert (job.error.code, job.error.param) == ("invalid_training_file", "training_file")
    assert job.error.message == (
        f"{data.id} line 1: 'completion' is empty; there is nothing to learn"
    )
    events = [e.message for e in bob.fine_tuning.jobs.list_events(job.id)]
    assert events == [
        f"The job failed: {job.error.message}",
        f"Validating training file: {data.id}",
    ]


# -- bad input --------------------------------------------------------------------------


def test_bad_uploads_name_line_and_problem(alice, bob):
    before = [f.id for f in alice.files.list()]
    cases = [
        (b"", 400, "file", "train.jsonl is empty"),
        (chats(1) + b"\n{oops", 400, "file", "train.jsonl line 2: not valid JSON"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            400,
            "file",
            "line 1: no assistant turn",
        ),
        (chats(200), 413, "file", "larger than this tenant's max_file_bytes (4000 bytes)"),
        (  # valid JSON, not text: the tokenizer refused it when a job was created (500)
            b'{"prompt": "hi", "completion": "\\ud800"}',
            400,
            "file",
            "train.jsonl line 1: a string holds a lone surrogate escape",
        ),
        (b"[" * 1900 + b"]" * 1900, 400, "file", "line 1: not valid JSON here"),  # was 500
    ]
    for content, status, param, message in cases:
        err = refused(upload, alice, content)
        assert (err.status_code, err.param) == (status, param) and message in err.message
    # a raw U+2028 inside a JSON string is one JSONL line, as `symbiont finetune` reads it
    record = json.dumps({"prompt": "a\u2028b\u0085c", "completion": " d"}, ensure_ascii=False)
    accepted = upload(alice, record.encode() + b"\n" + chats(1))
    assert accepted.id
    alice.files.delete(accepted.id)
    # json refuses ints of over 4300 digits with a ValueError (bob has no size limit)
    huge = b'{"prompt": "hi", "completion": "x", "n": ' + b"9" * 5000 + b"}"
    err = refused(upload, bob, huge)
    assert (err.status_code, err.param) == (400, "file"), err.message
    assert "train.jsonl line 1: not valid JSON here" in err.message
    err = refused(alice.files.create, file=("x.jsonl", chats(1)), purpose="batch")
    assert (err.status_code, err.param) == (400, "purpose") and "must be 'fine-tune'" in err.message
    assert [f.id for f in alice.files.list()] == before, "a refused upload left a file"


def test_bad_job_requests_name_the_field(alice):
    good = upload(alice, chats(2)).id
    long = upload(alice, json.dumps({"prompt": "x" * 150, "completion": "y"}).encode()).id
    before = [j.id for j in alice.fine_tuning.jobs.list()]
    cases = [
        ({"model": "gpt-4o"}, 404, "model", "'gpt-4o' cannot be fine-tuned here"),
        ({"training_file": "file-missing"}, 404, "training_file", "no file with id 'file-missing'"),
        ({"validation_file": "file-missing"}, 404, "validation_file", "no file with id"),
        (
            {"training_file": long},
            400,
            "training_file",
            f"{long} line 1: 152 tokens, longer than the model's context (128 tokens)",
        ),
        ({"hyperparameters": {"n_epochs": 0}}, 400, "hyperparameters.n_epochs", "[1, 50], got 0"),
        ({"hyperparameters": {"batch_size": 10**6}}, 400, "hyperparameters.batch_size", "[1, 256]"),
        (
            {"hyperparameters": {"learning_rate_multiplier": 0}},
            400,
            "hyperparameters.learning_rate_multiplier",
            "(0, 10], got 0",
        ),
        (
            {"hyperparameters": {"learning_rate_multiplier": 10**400}},
            400,
            "hyperparameters.learning_rate_multiplier",
            "(0, 10], got 1000000000",
        ),
        ({"suffix": "no spaces"}, 400, "suffix", "letters, digits"),
        (  # a string here raised AttributeError: a 500
            {"method": {"type": "supervised", "supervised": "x"}},
            400,
            "method.supervised",
            "must be an object",
        ),
        (
            {"extra_body": {"window_positions": 0}},
            400,
            "window_positions",
            "must be an integer >= 1 (positions per co-serving window), got 0",
        ),
        (
            {"extra_body": {"peft": {"method": "prefix"}}},
            400,
            "peft.method",
            "is not trained by jobs, which train lora, dora, ia3, loha, lokr, vera",
        ),
        (
            {"extra_body": {"peft": {"r": 128}}},
            400,
            "peft.r",
            "above this server's max_lora_rank (64)",
        ),
        (  # DoRA is served as a LoRA slot: it trained, then failed to publish
            {"extra_body": {"peft": {"method": "dora", "r": 128}}},
            400,
            "peft.r",
            "above this server's max_lora_rank (64)",
        ),
        (
            {"extra_body": {"peft": {"method": "ia3", "dropout": 0.1}}},
            400,
            "peft.dropout",
            "method 'ia3' does not use it; leave it out",
        ),
        (
            {"extra_body": {"peft": {"target_modules": ["nope"]}}},
            400,
            "peft.target_modules",
            "'nope' is not a servable layer",
        ),
        (
            {"extra_body": {"peft": {"target_modules": ["lm_head"]}}},
            400,
            "peft.target_modules",
            "'lm_head' is not a servable layer",
        ),
    ]
    for changes, status, param, message in cases:
        body = {"model": BASE, "training_file": good, **changes}
        err = refused(alice.fine_tuning.jobs.create, **body)
        assert (err.status_code, err.param) == (status, param), (changes, err.message)
        assert message in err.message, (changes, err.message)
    # JSON as Python writes it may hold NaN and Infinity, which the openai client will not
    # send; a NaN stored in a job made every later read of the tenant's jobs a 500
    for alpha in ("NaN", "Infinity", "-1", "1" + "0" * 400):  # 10**400 overflowed: a 500
        body = f'{{"model": "{BASE}", "training_file": "{good}", "peft": {{"alpha": {alpha}}}}}'
        answer = httpx.post(
            f"{alice.base_url}fine_tuning/jobs",
            content=body,
            headers={
                "Authorization": f"Bearer {KEYS['alice']}",
                "Content-Type": "application/json",
            },
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "peft.alpha"
        assert "must be a number in (0, 1e+06]" in answer.json()["error"]["message"]
    assert [j.id for j in alice.fine_tuning.jobs.list()] == before, "a refused job was created"


def test_file_in_use_cannot_be_deleted(alice):
    used = upload(alice, chats(8)).id
    job = create(alice, used, hyperparameters={"n_epochs": 50, "batch_size": 1})
    err = refused(alice.files.delete, used)
    assert err.status_code == 409 and job.id in err.message
    alice.fine_tuning.jobs.cancel(job.id)
    assert alice.files.delete(used).deleted
    assert refused(alice.files.retrieve, used).status_code == 404


# -- durability -------------------------------------------------------------------------


@pytest.mark.parametrize("slo", [None, 0.05], ids=["plain", "coserved"])
def test_restart_finds_everything_and_resumes_exactly(model_dir, tmp_path, slo):
    """A job interrupted mid-run (its worker stopped between checkpoints, as by kill -9)
    resumes after a restart and ends with the adapter of an uninterrupted run, bitwise;
    also under --slo-tpot-ms, where both run their steps in windows of 5 positions in
    co-serving slots (whenever those come)."""
    engine = dataclasses.replace(ENGINE, slo_tpot_s=slo)
    config = ServerConfig(model=str(model_dir), port=0, engine=engine, jobs_dir=str(tmp_path))
    extra = (
        {"checkpoint_every": 3} if slo is None else {"checkpoint_every": 3, "window_positions": 5}
    )
    spec = {"hyperparameters": {"n_epochs": 3, "batch_size": 2}, "extra": extra}
    with BackgroundServer(config) as first:
        api = client(first, None)
        data = upload(api, chats(8))
        done = wait_for(api, create(api, data.id, suffix="first").id)
        reached = threading.Event()
        runner = runner_of(first)

        def pause_at_step_7(job_id: str, step: int) -> None:
            if step == 7:  # hold the worker here until the server stops it
                reached.set()
                runner.stopping.wait(60)

        runner.step_hook = pause_at_step_7
        interrupted = create(api, data.id, **spec)
        assert reached.wait(60), "the job never reached step 7"
        if slo is not None:  # the plan is saved before the first step
            plan = run_dir(first, interrupted.id) / PLAN_FILE
            assert json.loads(plan.read_text()) == {"window_positions": 5}
    with BackgroundServer(config) as second:  # the same jobs dir
        api = client(second, None)
        assert api.files.retrieve(data.id).bytes == len(chats(8))
        assert api.fine_tuning.jobs.retrieve(done.id).status == "succeeded"
        assert done.fine_tuned_model in [m.id for m in api.models.list()]
        assert greedy(api, done.fine_tuned_model, "hi 1") == reference_text(
            model_dir, {"ft": run_dir(second, done.id)}, "ft", "hi 1"
        )
        uninterrupted = create(api, data.id, **spec)
        resumed = wait_for(api, interrupted.id)
        assert resumed.status == "succeeded", resumed.error
        assert wait_for(api, uninterrupted.id).status == "succeeded"
        events = list(api.fine_tuning.jobs.list_events(interrupted.id, limit=100))
        assert "Resumed after a restart" in [e.message for e in events]
        steps = [e.data["step"] for e in events if e.type == "metrics"]
        assert sorted(steps) == list(range(1, 13)), "each step's metrics once, as one run"
        assert (
            resumed.trained_tokens == api.fine_tuning.jobs.retrieve(uninterrupted.id).trained_tokens
        )
        a = load_file(run_dir(second, interrupted.id) / "adapter_model.safetensors")
        b = load_file(run_dir(second, uninterrupted.id) / "adapter_model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs after resume"
        if slo is not None:  # 18 steps here (6 resumed, 12 uninterrupted), cut into windows
            history = runner_of(second).coserve.history
            assert all(r.forward_tokens <= 2 * 5 * r.windows[0] for r in history)
            assert sum(r.windows[0] for r in history) >= 2 * 18
        steps = [c.step_number for c in api.fine_tuning.jobs.checkpoints.list(interrupted.id)]
        assert steps == [12, 9, 6, 3]


def test_a_job_stopped_before_its_first_checkpoint_logs_each_step_once(model_dir, tmp_path):
    """Restarted from step 0 (no checkpoint yet), the job trains its first steps again:
    their events from the stopped run went only when there was a checkpoint to resume
    from, so steps 1-2 were listed twice."""
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, jobs_dir=str(tmp_path))
    spec = {"hyperparameters": {"n_epochs": 1, "batch_size": 1}, "extra": {"checkpoint_every": 6}}
    with BackgroundServer(config) as first:
        api = client(first, None)
        reached, runner = threading.Event(), runner_of(first)

        def pause_at_step_2(job_id: str, step: int) -> None:
            if step == 2:  # hold the worker here until the server stops it
                reached.set()
                runner.stopping.wait(60)

        runner.step_hook = pause_at_step_2
        job = create(api, upload(api, chats(8)).id, **spec)
        assert reached.wait(60), "the job never reached step 2"
    with BackgroundServer(config) as second:
        api = client(second, None)
        assert wait_for(api, job.id).status == "succeeded"
        events = list(api.fine_tuning.jobs.list_events(job.id, limit=100))
        steps = [e.data["step"] for e in events if e.type == "metrics"]
        assert sorted(steps) == list(range(1, 9)), "each step's metrics once, as one run"


def test_a_job_stopped_while_publishing_keeps_one_results_file(model_dir, tmp_path):
    """Stopped after writing its results file and before `succeeded`, the job ends again
    after a restart: it left a second results file, referenced by nothing."""
    config = ServerConfig(model=str(model_dir), port=0, engine=ENGINE, jobs_dir=str(tmp_path))
    with BackgroundServer(config) as first:
        api = client(first, None)
        data = upload(api, chats(2))
        runner = runner_of(first)
        deadline = time.monotonic() + 60
        while runner.site is None:  # the jobs worker is still starting
            assert time.monotonic() < deadline, "the jobs worker never started"
            time.sleep(0.05)
        reached = threading.Event()

        def publish(name: str, folder: str) -> None:  # the process stops meanwhile
            reached.set()
            runner.stopping.wait(60)
            raise RuntimeError("the engine stopped (test)")

        runner.site = dataclasses.replace(runner.site, publish=publish)
        job = create(api, data.id)
        assert reached.wait(120), "the job never got to publishing"
    with BackgroundServer(config) as second:
        api = client(second, None)
        done = wait_for(api, job.id)
        assert done.status == "succeeded", done.error
        results = [f.id for f in api.files.list() if f.purpose == "fine-tune-results"]
        assert results == done.result_files, (results, done.result_files)


# -- kill -9 and SIGTERM of the real `symbiont serve` -------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _status(jobs_dir: Path, job_id: str) -> str:
    """A job's status read from the store while no server holds the jobs dir."""
    store = JobStore(jobs_dir)
    try:
        return store.get_job(None, job_id).status
    finally:
        store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(model_dir: Path, jobs_dir: Path, log: Path):
    """`symbiont serve --jobs-dir` in a child process; yields (process, client)."""
    port = _free_port()
    argv = [
        sys.executable, "-m", "symbiont", "serve", "--model", str(model_dir), "--port", str(port),
        "--jobs-dir", str(jobs_dir), "--max-running", "8", "--max-batched-tokens", "24",
        "--block-size", "4", "--num-blocks", "256",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"serve exited:\n{log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield process, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_kill_9_mid_job_then_restart_resumes_exactly(model_dir, tmp_path):
    jobs_dir, log = tmp_path / "jobs", tmp_path / "serve.log"
    spec = {"hyperparameters": {"n_epochs": 3, "batch_size": 1}, "extra": {"checkpoint_every": 2}}
    with serve_process(model_dir, jobs_dir, log) as (process, api):
        data = upload(api, chats(8))
        killed = create(api, data.id, suffix="killed", **spec)  # 24 steps
        while not list(api.fine_tuning.jobs.checkpoints.list(killed.id)):
            time.sleep(0.02)
        process.kill()  # kill -9 between checkpoints
        process.wait()
    assert _status(jobs_dir, killed.id) == "running"
    with serve_process(model_dir, jobs_dir, log) as (process, api):
        uninterrupted = create(api, data.id, suffix="whole", **spec)
        resumed = wait_for(api, killed.id)
        assert resumed.status == "succeeded", resumed.error
        assert wait_for(api, uninterrupted.id).status == "succeeded"
        events = list(api.fine_tuning.jobs.list_events(killed.id, limit=200))
        assert "Resumed after a restart" in [e.message for e in events]
        steps = [e.data["step"] for e in events if e.type == "metrics"]
        assert sorted(steps) == list(range(1, 25)), "each step's metrics once, as one run"
        a = load_file(jobs_dir / "runs" / killed.id / "adapter_model.safetensors")
        b = load_file(jobs_dir / "runs" / uninterrupted.id / "adapter_model.safetensors")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs after kill -9 and resume"
        # SIGTERM with a job running: the server exits cleanly, the job waits to resume
        pending = create(api, data.id, **spec)
        wait_for(api, pending.id, ("running",))
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then ends by the signal it caught
        assert process.wait(15) in (0, -signal.SIGTERM), log.read_text(errors="replace")
    text = log.read_text(errors="replace")
    assert "Application shutdown complete" in text and "Traceback" not in text
    assert _status(jobs_dir, pending.id) == "running"


def test_jobs_created_at_once_stay_within_max_concurrent_jobs(server):
    """Creates sent at the same time all passed the limit while their files were read
    and tokenized, and the tenant got as many jobs as it sent."""
    erin = client(server, "erin")  # one job at a time
    file_id = upload(erin, chats(8)).id
    barrier, outcomes = threading.Barrier(5), []

    def send():
        barrier.wait()
        try:
            outcomes.append(
                create(erin, file_id, hyperparameters={"n_epochs": 50, "batch_size": 1}).id
            )
        except openai.APIStatusError as err:
            outcomes.append(err.status_code)

    threads = [threading.Thread(target=send) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    admitted = [o for o in outcomes if isinstance(o, str)]
    assert len(admitted) == 1 and sorted(o for o in outcomes if o != admitted[0]) == [429] * 4
    erin.fine_tuning.jobs.cancel(admitted[0])
    assert wait_for(erin, admitted[0]).status == "cancelled"


def test_a_job_whose_model_could_not_be_served_is_refused_up_front(model_dir, tmp_path):
    """With every adapter slot promised (models served by name, jobs that will publish
    one), a new job was accepted, trained to the end, then failed: 'all adapter slots are
    in use'. It is now refused when created, saying what frees a slot."""
    engine = dataclasses.replace(ENGINE, max_adapters=1)
    config = ServerConfig(model=str(model_dir), port=0, engine=engine, jobs_dir=str(tmp_path))
    with BackgroundServer(config) as server:
        api = client(server, None)
        data = upload(api, chats(2))
        first = create(api, data.id)  # takes the one slot: running, or served once done
        err = refused(create, api, data.id)
        assert err.status_code == 409 and err.code == "no_adapter_slot", err.message
        assert "1 of --max-loras 1 are held" in err.message and "DELETE /v1/adapters" in err.message
        assert [j.id for j in api.fine_tuning.jobs.list()] == [first.id]
