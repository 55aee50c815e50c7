"""The fine-tuning worker: one background thread of the serve process that runs the jobs
of every tenant, one at a time, oldest first, through the engine's own base executor.

Each job trains with `symbiont.train` (TrainConfig, the loop, atomic checkpoints every
`checkpoint_every` steps). A job left `running` by a process that died (kill -9, power
loss) or stopped (SIGTERM) is resumed first when the worker starts again, from its last
checkpoint, exactly: `train(resume=True)` restores adapter, optimizer, schedule and RNG,
so the resumed run takes bit-for-bit the steps the uninterrupted one would have.

A cancel or a stop takes effect at the next base-layer call of the job (the executor
wrapper runs `_check` first), so within one layer's compute, not one whole step.
Finished adapters are handed to `publish` (the server registers them with its engine);
a job that fails ends `failed` with an error object and an event, and the worker goes on.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from symbiont.jobs.examples import Tokenizing
from symbiont.jobs.priority import PriorityGate, TrainingExecutor
from symbiont.jobs.store import JobRecord, JobStore, now
from symbiont.jobs.validation import JobsError, JobSpec
from symbiont.protocol.executor import Executor
from symbiont.train.checkpoints import STATE_FILE, latest_checkpoint, list_checkpoints
from symbiont.train.config import TrainConfig
from symbiont.train.loop import METRICS_FILE

log = logging.getLogger(__name__)

CHECKPOINTS_PER_RUN = 10  # when the job does not say: a checkpoint every tenth of the run


@dataclass(frozen=True)
class Worksite:
    """What the worker needs from the server, available once the engine has loaded."""

    model_dir: str
    base_name: str  # the base model's name in the API
    executor: Executor  # the engine's base executor (or a connection to the same serve-base)
    tokenizing: Tokenizing
    publish: Callable[[str, str], None]  # (model name, adapter folder): serve it now
    unpublish: Callable[[str], None]


class _Abandon(Exception):
    """Raised inside a job's step: the job was cancelled, or the server is stopping."""


class JobRunner:
    def __init__(self, store: JobStore, gate: PriorityGate | None = None):
        self.store = store
        self.gate = gate or PriorityGate()
        self.site: Worksite | None = None
        self.current: str | None = None  # id of the job being trained
        self.step_hook: Callable[[str, int], None] | None = None  # tests: after each step
        self.validation_hook: Callable[[str], None] | None = None  # tests: before a check
        self.coserve = None  # CoServe under --slo-tpot-ms: steps run in engine slots
        self._cancelled: set[str] = set()  # ids of jobs cancelled while they may run
        self._recorded: set[str] = set()  # checkpoint folders of the current job with a row
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="symbiont-jobs", daemon=True)
        self._site_ready = threading.Event()
        self.republished = threading.Event()  # finished models are served again

    # -- control (any thread) ---------------------------------------------------------

    def start(self) -> JobRunner:
        self._thread.start()
        return self

    def attach(self, site: Worksite) -> None:
        """The engine is ready: serve finished models again, then run jobs."""
        self.site = site
        self._site_ready.set()

    def wake(self) -> None:
        """A job was queued."""
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """The job's status is already `cancelled`; stop training it if it runs."""
        self._cancelled.add(job_id)  # only this job, whichever the worker holds now

    def stop(self, timeout: float = 30.0) -> None:
        """Abandon the running job where it is (it stays `running` and resumes from its last
        checkpoint at the next start) and end the thread."""
        self._stopping.set()
        self._wake.set()
        self._site_ready.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def stopping(self) -> threading.Event:
        """Set once `stop` was called."""
        return self._stopping

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the worker thread ------------------------------------------------------------

    def _main(self) -> None:
        self._site_ready.wait()
        if self._stopping.is_set():
            return
        try:
            self._republish()
        finally:
            self.republished.set()
        for job in self.store.validating_jobs():  # left mid-check by a previous process
            self.validate(job.id)
        while not self._stopping.is_set():
            job = self.store.next_runnable()
            if job is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            self._run(job)

    def validate(self, job_id: str) -> None:
        """Check a `validating_files` job's stored files as training will read them (they
        parse, tokenize and fit the context), then make it `queued`; or `failed` with an
        error object and an event. Runs off the event loop (the route hands it to a
        thread) and in the worker at start for jobs a previous process left here."""
        job = self.store.get_job(None, job_id)
        if job is None or job.status != "validating_files":
            return  # cancelled meanwhile
        if self.validation_hook is not None:
            self.validation_hook(job_id)
        spec = JobSpec(**job.spec)
        try:
            found = len(self._examples(spec.training_file, "training_file"))
            self._examples(spec.validation_file, "validation_file")
        except Exception as err:  # noqa: BLE001 - the job fails, the server goes on
            error = _error_of(err)
            self.store.transition(
                job.id,
                "failed",
                only_from=("validating_files",),
                event=("error", f"The job failed: {error['message']}"),
                error=error,
                finished_at=now(),
            )
            return
        self.store.transition(
            job.id,
            "queued",
            only_from=("validating_files",),
            event=("info", f"Files validated ({found} training examples); queued"),
        )
        self.wake()

    def _republish(self) -> None:
        """After a restart, every succeeded job's model is served again."""
        for job in self.store.succeeded_jobs():
            try:
                self.site.publish(job.fine_tuned_model, str(self.store.run_dir(job.id)))
            except Exception as err:  # noqa: BLE001 - one unservable model must not stop the rest
                log.error("cannot serve %s again: %s", job.fine_tuned_model, err)
                self.store.add_event(job.id, "warn", f"Not served after a restart: {err}")

    def _run(self, job: JobRecord) -> None:
        resumed = job.status == "running"
        event = ("info", "Resumed after a restart" if resumed else "Fine-tuning job started")
        if not self.store.transition(
            job.id, "running", only_from=("running",) if resumed else ("queued",), event=event
        ):
            self._cancelled.discard(job.id)
            return  # cancelled meanwhile
        self.current, self._recorded = job.id, set()
        try:
            self._finish(job, self._train(job))
        except _Abandon:
            log.info("job %s %s", job.id, self._why_abandoned(job.id))
        except Exception as err:  # noqa: BLE001 - the job fails, the worker goes on
            if self._why_abandoned(job.id):  # raised from inside autograd while abandoning
                log.info("job %s %s", job.id, self._why_abandoned(job.id))
            else:
                self._fail(job, err)
        finally:
            self.current = None
            self._cancelled.discard(job.id)
            gc.collect()

    def _check(self) -> None:
        why = self._why_abandoned(self.current)
        if why:
            raise _Abandon(why)

    def _why_abandoned(self, job_id: str | None) -> str | None:
        if job_id in self._cancelled:
            return "cancelled"
        return "paused until the next start" if self._stopping.is_set() else None

    def _train(self, job: JobRecord) -> dict:
        import peft
        import torch

        from symbiont.adapters.peft_config import build_peft_config
        from symbiont.client.loader import load_client
        from symbiont.train.data import pad_id
        from symbiont.train.loop import train

        site, spec = self.site, JobSpec(**job.spec)
        examples = self._examples(spec.training_file, "training_file")
        evals = self._examples(spec.validation_file, "validation_file")
        config = train_config(spec, len(examples), site.tokenizing.max_length)
        total = config.total_steps(len(examples))
        executor = TrainingExecutor(site.executor, self.gate, self._check)
        model = load_client(site.model_dir, executor)
        torch.manual_seed(spec.seed)  # adapter initialisation (the worker is the only user)
        model = peft.get_peft_model(model, build_peft_config(spec.adapter_flags(), total))
        out = self.store.run_dir(job.id)
        checkpoint = latest_checkpoint(out)
        # A restart resumes from the last checkpoint (or from step 0 without one): the steps
        # after it are trained again, so their events go, and the events read as one run.
        step = 0
        if checkpoint is not None:
            step = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))["step"]
        self.store.drop_metrics_after(job.id, step)

        def on_step(record: dict) -> None:
            self._on_step(job, record, total, out)

        common = dict(
            pad_token_id=pad_id(site.tokenizing.tokenizer),
            eval_examples=evals,
            resume=checkpoint is not None,  # after a restart: exactly from there
            progress=False,
            on_step=on_step,
        )
        if self.coserve is None:
            result = train(model, examples, config, out, **common)
        else:  # token-level steps in the slots the engine grants (symbiont/jobs/coserve.py)
            from symbiont.jobs.coserve import profile, train_coserved

            profile(model, self.coserve.cost, model.config.vocab_size, rows=config.batch_size)
            result = train_coserved(
                model,
                examples,
                config,
                out,
                coserve=self.coserve,
                check=self._check,
                plan=spec.window_positions or None,
                **common,
            )
        self._record_checkpoints(job, out)
        return {"steps": result.steps, "eval_loss": result.eval_loss, "loss": result.final_loss}

    def _examples(self, file_id: str | None, param: str):
        if file_id is None:
            return []
        try:  # it may vanish (disk trouble, a deletion) at any moment, also while read
            content = self.store.file_path(file_id).read_bytes()
        except FileNotFoundError:
            raise JobsError(400, f"{param}: the file {file_id} is gone", param) from None
        return self.site.tokenizing.examples(content, file_id, param)

    def _on_step(self, job: JobRecord, record: dict, total: int, out: Path) -> None:
        self._record_checkpoints(job, out)
        data = {"step": record["step"], "total_steps": total, "train_loss": record["loss"]}
        message = f"Step {record['step']}/{total}: training loss={record['loss']:.4f}"
        if "eval_loss" in record:
            data["valid_loss"] = record["eval_loss"]
            message += f", validation loss={record['eval_loss']:.4f}"
        self.store.add_event(job.id, "info", message, "metrics", data)
        if self.step_hook is not None:
            self.step_hook(job.id, record["step"])
        self._check()

    def _record_checkpoints(self, job: JobRecord, out: Path) -> None:
        """Rows for checkpoints written since the last look (the loop saves after logging)."""
        new = [p for p in list_checkpoints(out) if p.name not in self._recorded]
        metrics = _metrics_by_step(out) if new else {}
        for folder in new:
            self._recorded.add(folder.name)
            step = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))["step"]
            record = metrics.get(step, {})
            values = {"step": step, "train_loss": record.get("loss")}
            if "eval_loss" in record:
                values["valid_loss"] = record["eval_loss"]
            name = f"{model_name(self.site.base_name, job)}:ckpt-step-{step}"
            if self.store.add_checkpoint(job.id, step, values, name):
                self.store.add_event(job.id, "info", f"Checkpoint saved at step {step}")

    def _finish(self, job: JobRecord, result: dict) -> None:
        self._check()
        out = self.store.run_dir(job.id)
        name = model_name(self.site.base_name, job)
        tokens = _trained_tokens(out)
        filename = f"{job.id}-results.csv"
        # One left by a run stopped between writing it and `succeeded` is replaced, not kept
        # beside the new one (a restart resumes at the last checkpoint and ends here again).
        stale, _ = self.store.list_files(job.tenant, purpose="fine-tune-results")
        for record in stale:
            if record.filename == filename:
                self.store.delete_file(job.tenant, record.id)
        results = self.store.add_file(job.tenant, filename, "fine-tune-results", _results_csv(out))
        try:
            self.site.publish(name, str(out))  # served before anyone can see `succeeded`
        except BaseException:
            self.store.delete_file(job.tenant, results.id)
            raise
        done = self.store.transition(
            job.id,
            "succeeded",
            only_from=("running",),
            event=("info", f"The job has successfully completed: {name} is served"),
            fine_tuned_model=name,
            finished_at=now(),
            trained_tokens=tokens,
            result_files=[results.id],
        )
        if not done:  # cancelled in the last instant
            self.site.unpublish(name)
            self.store.delete_file(job.tenant, results.id)

    def _fail(self, job: JobRecord, err: Exception) -> None:
        error = _error_of(err)
        self.store.transition(
            job.id,
            "failed",
            only_from=("running",),
            event=("error", f"The job failed: {error['message']}"),
            error=error,
            finished_at=now(),
        )


def _error_of(err: Exception) -> dict:
    """A job's `error` object: bad data names its field, anything else is logged."""
    if isinstance(err, JobsError):
        return {"code": "invalid_training_file", "message": str(err), "param": err.param}
    log.error("job failed", exc_info=err)
    message = f"training failed: {type(err).__name__}: {err}"
    return {"code": "training_failed", "message": message, "param": None}


def train_config(spec: JobSpec, n_examples: int, max_length: int) -> TrainConfig:
    """The TrainConfig of a job; the same on every (re)start, as exact resume requires."""
    probe = TrainConfig(epochs=spec.n_epochs, batch_size=spec.batch_size, max_length=max_length)
    every = spec.checkpoint_every or math.ceil(probe.total_steps(n_examples) / CHECKPOINTS_PER_RUN)
    return TrainConfig(
        epochs=spec.n_epochs,
        batch_size=spec.batch_size,
        lr=spec.learning_rate,
        seed=spec.seed,
        max_length=max_length,
        save_every=every,
        save_total_limit=0,  # every checkpoint stays listed and usable
        log_every=1,
    )


def model_name(base: str, job: JobRecord) -> str:
    """OpenAI's form: ft:<base>:<tenant>:<suffix>:<job id tail>."""
    return f"ft:{base}:{job.tenant}:{job.spec['suffix'] or ''}:{job.id.split('-')[-1][:8]}"


def _metrics_by_step(out: Path) -> dict[int, dict]:
    path = out / METRICS_FILE
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    records = (json.loads(line) for line in lines if line.strip())
    return {record["step"]: record for record in records}


def _trained_tokens(out: Path) -> int | None:
    found = list_checkpoints(out)
    if not found:
        return None
    return json.loads((found[-1] / STATE_FILE).read_text(encoding="utf-8"))["tokens"]


def _results_csv(out: Path) -> bytes:
    """OpenAI's result file: one row per step."""
    rows = ["step,train_loss,valid_loss,learning_rate,tokens"]
    for step, record in sorted(_metrics_by_step(out).items()):
        valid = record.get("eval_loss", "")
        rows.append(f"{step},{record['loss']},{valid},{record['lr']},{record['tokens']}")
    return ("\n".join(rows) + "\n").encode()
