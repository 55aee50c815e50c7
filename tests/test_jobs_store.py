"""The jobs package without a server: the SQLite store (durable, per tenant, nothing
half-created), upload and request checks (each names the line or field), tenants (keys
plain or sha256, constant-time match, rate limits) and the inference-first gate."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
import torch

from symbiont.jobs.priority import InferenceExecutor, PriorityGate, TrainingExecutor
from symbiont.jobs.store import JobStore
from symbiont.jobs.tenants import RateLimiter, authenticate, load_tenants, retry_after
from symbiont.jobs.validation import JobsError, job_spec, parse_training_file

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def jsonl(*records) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records).encode()


def spec(**changes) -> dict:
    body = {"model": "base", "training_file": "file-1", **changes}
    return job_spec(body, "base").as_record()


# -- store ------------------------------------------------------------------------------


def test_store_survives_reopen_and_keeps_tenants_apart(tmp_path):
    store = JobStore(tmp_path)
    a = store.add_file("alice", "a.jsonl", "fine-tune", jsonl(CHAT))
    job = store.add_job("alice", spec(training_file=a.id), [("info", "queued")])
    store.close()

    again = JobStore(tmp_path)  # a restart
    assert again.get_file("alice", a.id) == a
    assert again.file_path(a.id).read_bytes() == jsonl(CHAT)
    assert again.get_job("alice", job.id) == job
    assert again.get_file("bob", a.id) is None, "bob must not see alice's file"
    assert again.get_job("bob", job.id) is None, "bob must not see alice's job"
    assert again.list_jobs("bob") == ([], False)
    assert again.delete_file("bob", a.id) is False and again.file_path(a.id).exists()
    events, _ = again.list_events(job.id)
    assert [e["message"] for e in events] == ["queued"]
    mode = again._query("PRAGMA journal_mode")[0][0]
    assert mode == "wal"


def test_pages_are_newest_first_with_cursor(tmp_path):
    store = JobStore(tmp_path)
    ids = [store.add_file("t", f"{i}.jsonl", "fine-tune", jsonl(CHAT)).id for i in range(5)]
    page, more = store.list_files("t", limit=2)
    assert [f.id for f in page] == ids[::-1][:2] and more
    page, more = store.list_files("t", after=page[-1].id, limit=10)
    assert [f.id for f in page] == ids[::-1][2:] and not more


def test_orphan_file_without_a_row_is_removed_at_open(tmp_path):
    JobStore(tmp_path).close()
    orphan = tmp_path / "files" / "file-orphan"  # a kill between rename and insert
    orphan.write_bytes(b"x")
    JobStore(tmp_path)
    assert not orphan.exists()


def test_transitions_only_from_the_given_states(tmp_path):
    store = JobStore(tmp_path)
    job = store.add_job("t", spec(), [])
    assert store.transition(job.id, "running", only_from=("queued",))
    assert store.transition(
        job.id, "cancelled", only_from=("queued", "running"), event=("info", "Job cancelled")
    )
    # the worker's late success must not overwrite the cancel
    assert not store.transition(job.id, "succeeded", only_from=("running",), event=("info", "x"))
    assert store.get_job("t", job.id).status == "cancelled"
    assert [e["message"] for e in store.list_events(job.id)[0]] == ["Job cancelled"]
    assert store.next_runnable() is None


def test_running_jobs_resume_before_queued_ones(tmp_path):
    store = JobStore(tmp_path)
    first = store.add_job("t", spec(), [])
    second = store.add_job("t", spec(), [])
    store.transition(second.id, "running", only_from=("queued",))
    assert store.next_runnable().id == second.id
    store.transition(second.id, "failed", only_from=("running",))
    assert store.next_runnable().id == first.id


def test_jobs_validating_their_files_wait_and_are_found_again_after_a_restart(tmp_path):
    store = JobStore(tmp_path)
    f = store.add_file("t", "a.jsonl", "fine-tune", jsonl(CHAT))
    job = store.add_job("t", spec(training_file=f.id), [], status="validating_files")
    assert store.next_runnable() is None  # not run before its files are checked
    assert store.jobs_using_file("t", f.id) == [job.id]  # nor its file deleted meanwhile
    store.close()
    store = JobStore(tmp_path)  # a process died mid-check: the next one checks again
    assert [j.id for j in store.validating_jobs()] == [job.id]
    assert store.transition(job.id, "queued", only_from=("validating_files",))
    assert store.validating_jobs() == [] and store.next_runnable().id == job.id


def test_file_in_use_by_an_active_job(tmp_path):
    store = JobStore(tmp_path)
    f = store.add_file("t", "a.jsonl", "fine-tune", jsonl(CHAT))
    job = store.add_job("t", spec(training_file=f.id), [])
    assert store.jobs_using_file("t", f.id) == [job.id]
    store.transition(job.id, "succeeded", only_from=("queued",))
    assert store.jobs_using_file("t", f.id) == []


# -- uploads ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "train.jsonl is empty"),
        (b"  \n\n", "train.jsonl is empty"),
        (jsonl(CHAT, "{not json"), "train.jsonl line 2: not valid JSON"),
        (jsonl([1, 2]), "train.jsonl line 1: expected a JSON object, got list"),
        (
            jsonl({"text": "x"}),
            "line 1: a record needs 'messages' (a chat) or 'prompt' and 'completion'",
        ),
        (jsonl({"messages": []}), "line 1: 'messages' must be a non-empty list"),
        (
            jsonl({"messages": [{"role": "user"}]}),
            "line 1: messages[0] must be an object with string 'role' and 'content'",
        ),
        (
            jsonl(CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
            "line 2: no assistant turn",
        ),
        (  # was accepted, then refused by the chat template at job creation
            jsonl({"messages": [{"role": "wizard", "content": "hi"}, *CHAT["messages"]]}),
            "line 1: messages[0].role 'wizard' is not one of system, developer, user",
        ),
        (jsonl({"prompt": "a"}), "line 1: 'completion' must be a string"),
        (jsonl({"prompt": "a", "completion": ""}), "line 1: 'completion' is empty"),
        (b"\xff\xfe", "train.jsonl is not UTF-8 text"),
    ],
)
def test_bad_training_files_name_line_and_problem(content, message):
    with pytest.raises(JobsError, match=None) as caught:
        parse_training_file(content, "train.jsonl")
    assert message in str(caught.value) and caught.value.param == "file"
    assert caught.value.status == 400


def test_good_training_file():
    records = parse_training_file(jsonl(CHAT, "", {"prompt": "a", "completion": "b"}), "t")
    assert [n for n, _ in records] == [1, 3]


# -- job requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, param, message",
    [
        ({"model": "other"}, "model", "'other' cannot be fine-tuned here"),
        ({"training_file": None}, "training_file", "training_file: required"),
        ({"validation_file": 3}, "validation_file", "validation_file: must be a file id"),
        (
            {"hyperparameters": {"n_epochs": 0}},
            "hyperparameters.n_epochs",
            "integer in [1, 50], got 0",
        ),
        (
            {"hyperparameters": {"batch_size": 1000}},
            "hyperparameters.batch_size",
            "in [1, 256], got 1000",
        ),
        (
            {"hyperparameters": {"learning_rate_multiplier": -1}},
            "hyperparameters.learning_rate_multiplier",
            "(0, 10], got -1",
        ),
        (
            {"hyperparameters": {"learning_rate_multiplier": float("nan")}},
            "hyperparameters.learning_rate_multiplier",
            "got nan",
        ),
        ({"hyperparameters": {"warmup": 3}}, "hyperparameters.warmup", "unknown"),
        ({"method": {"type": "dpo"}}, "method", "only 'supervised'"),
        ({"suffix": "a b"}, "suffix", "letters, digits"),
        ({"seed": -1}, "seed", "seed: must be an integer"),
        (
            {"peft": {"method": "prefix"}},
            "peft.method",
            "'prefix' is not trained by jobs, which train lora, dora, ia3, loha, lokr, vera",
        ),
        (
            {"peft": {"method": "magic"}},
            "peft.method",
            "'magic' is not one of lora, dora, ia3, loha, lokr, vera",
        ),
        ({"peft": {"r": 0}}, "peft.r", "peft.r: must be an integer in [1, 256]"),
        ({"peft": {"dropout": 1.5}}, "peft.dropout", "[0, 1)"),
        ({"peft": {"rank": 4}}, "peft.rank", "unknown"),
        (
            {"peft": {"target_modules": "q_proj"}},
            "peft.target_modules",
            "'all-linear' or a non-empty list",
        ),
        ({"checkpoint_every": 0}, "checkpoint_every", ">= 1"),
        ({"foo": 1}, "foo", "foo: unknown field; a job takes model, training_file"),
        ({"integrations": [{"type": "wandb"}]}, "integrations", "not offered"),
    ],
)
def test_bad_job_requests_name_the_field(changes, param, message):
    with pytest.raises(JobsError) as caught:
        job_spec({"model": "base", "training_file": "file-1", **changes}, "base")
    assert caught.value.param == param
    assert message in str(caught.value)


def test_job_request_defaults_and_method_form():
    s = job_spec({"model": "base", "training_file": "f"}, "base")
    assert (s.n_epochs, s.batch_size, s.learning_rate_multiplier) == (3, 4, 1.0)
    assert s.peft == {"method": "lora", "r": 8, "alpha": None, "dropout": 0.0, "target": None}
    hyper = {"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": 0.5}
    body = {"method": {"type": "supervised", "supervised": {"hyperparameters": hyper}}}
    s = job_spec({"model": "base", "training_file": "f", **body}, "base")
    assert (s.n_epochs, s.batch_size, s.learning_rate_multiplier) == (2, 1, 0.5)
    s = job_spec(
        {"model": "base", "training_file": "f", "peft": {"target_modules": ["q_proj", "v_proj"]}},
        "base",
    )
    assert s.adapter_flags().target == "q_proj,v_proj"


# -- tenants ----------------------------------------------------------------------------


def write_tenants(tmp_path, data) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plain_and_hashed_keys(tmp_path):
    hashed = "sha256:" + hashlib.sha256(b"bob-key").hexdigest()
    tenants = load_tenants(
        write_tenants(tmp_path, {"alice": {"api_key": "alice-key"}, "bob": {"api_key": hashed}})
    )
    assert authenticate(tenants, "Bearer alice-key").name == "alice"
    assert authenticate(tenants, "Bearer bob-key").name == "bob"
    assert authenticate(tenants, f"Bearer {hashed}") is None, "the stored hash is not a key"
    assert authenticate(tenants, "Bearer nope") is None
    assert authenticate(tenants, "") is None
    assert authenticate(tenants, "Basic alice-key") is None
    assert tenants["alice"].max_concurrent_jobs == 2  # defaults


@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "expected an object of tenant name -> settings"),
        ({"a": {}}, "tenant 'a': api_key must be a non-empty string"),
        ({"a": {"api_key": "sha256:abc"}}, "needs 64 hex digits"),
        ({"a": {"api_key": "k", "max_file_bytes": 0}}, "max_file_bytes must be an integer >= 1"),
        ({"a": {"api_key": "k", "quota": 1}}, "unknown field 'quota'"),
        ({"a": {"api_key": "k"}, "b": {"api_key": "k"}}, "two tenants share one api_key"),
        ({"a b": {"api_key": "k"}}, "names are 1-64 letters"),
    ],
)
def test_bad_tenants_files(tmp_path, data, message):
    with pytest.raises(ValueError, match=None) as caught:
        load_tenants(write_tenants(tmp_path, data))
    assert message in str(caught.value)


def test_bad_tenants_file_paths(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        load_tenants(tmp_path / "missing.json")
    (tmp_path / "t.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tenants(tmp_path / "t.json")


def test_rate_limiter_sliding_window(tmp_path):
    clock = [0.0]
    limiter = RateLimiter(clock=lambda: clock[0])
    tenant = load_tenants(
        write_tenants(tmp_path, {"a": {"api_key": "k", "requests_per_minute": 2}})
    )["a"]
    assert limiter.admit(tenant) == 0 and limiter.admit(tenant) == 0
    clock[0] = 10.0
    assert limiter.admit(tenant) == pytest.approx(50.0)
    assert retry_after(limiter.admit(tenant)) == "50"
    clock[0] = 60.0
    assert limiter.admit(tenant) == 0  # the first request left the window


# -- priority ---------------------------------------------------------------------------


class _Recorder:
    manifest = None

    def __init__(self):
        self.calls = []

    def call(self, op, layer, x):
        self.calls.append((threading.current_thread().name, layer))
        return x


def test_training_calls_wait_for_inference_calls_in_flight():
    gate = PriorityGate(max_wait_s=5.0)
    inner = _Recorder()
    training = TrainingExecutor(inner, gate, check=lambda: None)
    gate.inference_started()  # an inference call is running
    worker = threading.Thread(target=training.call, args=(1, 7, torch.zeros(1)), name="train")
    worker.start()
    time.sleep(0.2)
    assert inner.calls == [], "a fine-tuning call ran while inference was in flight"
    InferenceExecutor(inner, gate).call(1, 3, torch.zeros(1))  # inference goes ahead
    gate.inference_done()
    worker.join(5)
    assert [layer for _, layer in inner.calls] == [3, 7]


def test_training_is_never_starved():
    gate = PriorityGate(max_wait_s=0.05)
    inner = _Recorder()
    gate.inference_started()  # inference never finishes
    started = time.perf_counter()
    TrainingExecutor(inner, gate, check=lambda: None).call(1, 0, torch.zeros(1))
    assert inner.calls and time.perf_counter() - started < 2.0


def test_training_check_runs_before_each_call():
    def cancelled():
        raise RuntimeError("cancelled")

    inner = _Recorder()
    with pytest.raises(RuntimeError, match="cancelled"):
        TrainingExecutor(inner, PriorityGate(), check=cancelled).call(1, 0, torch.zeros(1))
    assert inner.calls == []


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tenants": "missing.json"}, "cannot read it"),
        ({"tenants": "tenants.json", "api_key": "k"}, "--tenants gives each tenant its key"),
    ],
)
def test_server_config_checks_tenants(tmp_path, monkeypatch, changes, message):
    from symbiont.serve.config import ServerConfig

    monkeypatch.chdir(tmp_path)
    write_tenants(tmp_path, {"a": {"api_key": "k"}})
    with pytest.raises(ValueError) as caught:
        ServerConfig(model="m", **changes)
    assert message in str(caught.value)
    ServerConfig(model="m", tenants="tenants.json", host="0.0.0.0")  # tenants authenticate


class _Overlap:
    """An executor that records how many calls ran at once."""

    manifest = None

    def __init__(self):
        self.running, self.most = 0, 0
        self._lock = threading.Lock()

    def call(self, op, layer, x):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.001)
        with self._lock:
            self.running -= 1
        return x


@pytest.mark.parametrize("shared", [True, False])
def test_calls_on_a_shared_executor_never_interleave(shared):
    """A shared executor object (masked ones keep state between calls) sees one call at a
    time; a worker with its own connection is not serialized."""
    inner = _Overlap()
    gate = PriorityGate(max_wait_s=0.0, shared=shared)
    sides = [InferenceExecutor(inner, gate), TrainingExecutor(inner, gate, check=lambda: None)]

    def hammer(side):
        for _ in range(40):
            side.call(1, 0, torch.zeros(1))

    threads = [threading.Thread(target=hammer, args=(side,)) for side in sides * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (inner.most == 1) == shared


def test_one_jobs_dir_is_one_servers(tmp_path):
    """A second store (another `symbiont serve`) on a jobs dir in use is refused by name:
    both would run the same jobs and delete each other's fresh uploads."""
    from symbiont.jobs.store import JobsDirBusy

    store = JobStore(tmp_path)
    with pytest.raises(JobsDirBusy, match=f"another symbiont serve is using --jobs-dir {tmp_path}"):
        JobStore(tmp_path)
    store.close()
    JobStore(tmp_path).close()  # free again once the first has closed
