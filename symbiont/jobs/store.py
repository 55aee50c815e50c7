"""The durable state of the jobs API: one SQLite database (standard library `sqlite3`, WAL)
plus the uploaded files and each job's training folder, all under `--jobs-dir`:

    jobs-dir/
      jobs.sqlite3          files, jobs, events, checkpoints (rows name their tenant)
      files/<file id>       uploaded JSONL, written to a temporary name then renamed
      runs/<job id>/        the job's training folder (symbiont.train's checkpoints, adapter)

Every change is one transaction, so a kill at any moment leaves each row either written or
not; a file is renamed into place before its row is inserted and its row deleted before the
file, and files without a row are removed at open, so nothing is ever half-created. Every
read takes the tenant, and a row of another tenant is simply not found (the API answers
404, exactly as for an id that does not exist).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ACTIVE = ("validating_files", "queued", "running")
TERMINAL = ("succeeded", "failed", "cancelled")
STATUSES = ACTIVE + TERMINAL

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    created_at INTEGER NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
    fine_tuned_model TEXT, error TEXT, finished_at INTEGER, trained_tokens INTEGER,
    result_files TEXT NOT NULL DEFAULT '[]'
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, level TEXT NOT NULL, message TEXT NOT NULL,
    type TEXT NOT NULL, data TEXT
);
CREATE TABLE IF NOT EXISTS checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, step INTEGER NOT NULL, metrics TEXT NOT NULL,
    name TEXT NOT NULL, UNIQUE (job_id, step)
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE INDEX IF NOT EXISTS checkpoints_by_job ON checkpoints (job_id, seq);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def as_openai(self) -> dict:
        """OpenAI's `file` object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant: str
    created_at: int
    spec: dict  # JobSpec.as_record()
    status: str
    fine_tuned_model: str | None = None
    error: dict | None = None
    finished_at: int | None = None
    trained_tokens: int | None = None
    result_files: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def as_openai(self) -> dict:
        """OpenAI's `fine_tuning.job` object; the PEFT settings ride along under `peft`."""
        spec = self.spec
        hyperparameters = {
            "n_epochs": spec["n_epochs"],
            "batch_size": spec["batch_size"],
            "learning_rate_multiplier": spec["learning_rate_multiplier"],
        }
        return {
            "id": self.id,
            "object": "fine_tuning.job",
            "created_at": self.created_at,
            "model": spec["model"],
            "organization_id": self.tenant,
            "training_file": spec["training_file"],
            "validation_file": spec["validation_file"],
            "hyperparameters": hyperparameters,
            "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
            "seed": spec["seed"],
            "suffix": spec["suffix"],
            "status": self.status,
            "fine_tuned_model": self.fine_tuned_model,
            "error": self.error,
            "finished_at": self.finished_at,
            "trained_tokens": self.trained_tokens,
            "result_files": list(self.result_files),
            "estimated_finish": None,
            "integrations": [],
            "metadata": spec.get("metadata"),
            "peft": _peft_shown(spec["peft"]),
        }


def _peft_shown(flags: dict) -> dict:
    """A job's PEFT settings as a request writes them (`target_modules`), with the alpha
    it trains with (2r unless given; methods without one have none)."""
    shown = {k: v for k, v in flags.items() if k != "target"}
    if shown.get("alpha") is None and flags.get("method") in ("lora", "dora", "loha", "lokr"):
        shown["alpha"] = 2 * flags["r"]
    target = flags.get("target")
    shown["target_modules"] = target.split(",") if target and target != "all-linear" else target
    return shown


class JobStore:
    """The database and folders under one jobs dir; safe to use from any thread."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.runs_dir = self.root / "runs"
        for folder in (self.root, self.files_dir, self.runs_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self._owner = _own(self.root)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.root / "jobs.sqlite3", isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a committed change survives power loss
        self._db.executescript(SCHEMA)
        self._remove_orphan_files()

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._owner is not None:
                os.close(self._owner)  # releases the jobs dir for the next server
                self._owner = None

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        if not all(_storable(arg) for arg in args):
            return []  # text SQLite cannot hold (a lone surrogate) names no stored row
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- files ------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, filename: str, purpose: str, content: bytes) -> FileRecord:
        """Write `content` durably, then its row; returns the record."""
        filename = filename.encode("utf-8", "replace").decode("utf-8")[:255]
        record = FileRecord(new_id("file"), tenant, filename, purpose, len(content), now())
        path = self.file_path(record.id)
        staging = path.with_name(f".{record.id}.partial")
        with open(staging, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
        try:
            with self._transaction() as db:
                db.execute(
                    "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (record.id, tenant, filename, purpose, record.bytes, record.created_at),
                )
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return record

    def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        rows = self._query("SELECT * FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        return _file(rows[0]) if rows else None

    def list_files(
        self, tenant: str, *, after: str | None = None, limit: int = 10000, purpose=None
    ) -> tuple[list[FileRecord], bool]:
        """Newest first, from after the file `after`; (page, whether more follow)."""
        where, args = "tenant = ?", [tenant]
        if purpose is not None:
            where += " AND purpose = ?"
            args.append(purpose)
        rows = self._page("files", where, args, after, limit)
        return [_file(r) for r in rows[:limit]], len(rows) > limit

    def jobs_using_file(self, tenant: str, file_id: str) -> list[str]:
        """Active jobs that still need `file_id`."""
        rows = self._query(
            f"SELECT id, spec FROM jobs WHERE tenant = ? AND status IN {ACTIVE!r}", (tenant,)
        )
        needed = []
        for row in rows:
            spec = json.loads(row["spec"])
            if file_id in (spec["training_file"], spec["validation_file"]):
                needed.append(row["id"])
        return needed

    def delete_file(self, tenant: str, file_id: str) -> bool:
        if self.get_file(tenant, file_id) is None:
            return False
        with self._transaction() as db:
            gone = db.execute(
                "DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)
            ).rowcount
        if gone:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(gone)

    def _remove_orphan_files(self) -> None:
        """Files whose row was never written (a kill between rename and insert)."""
        known = {row["id"] for row in self._query("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # -- jobs -------------------------------------------------------------------------

    def add_job(
        self, tenant: str, spec: dict, events: list[tuple[str, str]], status: str = "queued"
    ) -> JobRecord:
        """Insert a job (`validating_files` or `queued`) and its first events, in one
        transaction."""
        assert status in ("validating_files", "queued"), status
        job = JobRecord(new_id("ftjob"), tenant, now(), spec, status)
        with self._transaction() as db:
            db.execute(
                "INSERT INTO jobs (id, tenant, created_at, spec, status) VALUES (?, ?, ?, ?, ?)",
                (job.id, tenant, job.created_at, json.dumps(spec), job.status),
            )
            for level, message in events:
                _insert_event(db, job.id, level, message)
        return job

    def get_job(self, tenant: str | None, job_id: str) -> JobRecord | None:
        """The job `job_id` of `tenant` (None: of any tenant, for the runner)."""
        if tenant is None:
            rows = self._query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        else:
            rows = self._query("SELECT * FROM jobs WHERE id = ? AND tenant = ?", (job_id, tenant))
        return _job(rows[0]) if rows else None

    def list_jobs(
        self, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[JobRecord], bool]:
        rows = self._page("jobs", "tenant = ?", [tenant], after, limit)
        return [_job(r) for r in rows[:limit]], len(rows) > limit

    def count_active(self, tenant: str | None) -> int:
        """Jobs queued or running: the tenant's, or everyone's with None."""
        if tenant is None:
            return self._query(f"SELECT COUNT(*) AS n FROM jobs WHERE status IN {ACTIVE!r}")[0]["n"]
        rows = self._query(
            f"SELECT COUNT(*) AS n FROM jobs WHERE tenant = ? AND status IN {ACTIVE!r}", (tenant,)
        )
        return rows[0]["n"]

    def next_runnable(self) -> JobRecord | None:
        """The job to run next: one left running by a previous process first (to resume),
        then the oldest queued one."""
        rows = self._query(
            "SELECT * FROM jobs WHERE status IN ('running', 'queued') "
            "ORDER BY status = 'running' DESC, seq ASC LIMIT 1"
        )
        return _job(rows[0]) if rows else None

    def validating_jobs(self) -> list[JobRecord]:
        """Jobs whose files are still to be checked (a previous process may have died at it)."""
        rows = self._query("SELECT * FROM jobs WHERE status = 'validating_files' ORDER BY seq")
        return [_job(r) for r in rows]

    def succeeded_jobs(self) -> list[JobRecord]:
        rows = self._query("SELECT * FROM jobs WHERE status = 'succeeded' ORDER BY seq")
        return [_job(r) for r in rows]

    def model_owner(self, name: str) -> str | None:
        """The tenant whose job produced the fine-tuned model `name`, if any."""
        rows = self._query("SELECT tenant FROM jobs WHERE fine_tuned_model = ?", (name,))
        return rows[0]["tenant"] if rows else None

    def transition(
        self, job_id: str, to: str, *, only_from: tuple[str, ...], event=None, **fields
    ) -> bool:
        """Set `status` (and `fields`) if the job is in one of `only_from`; with the event
        (level, message[, type, data]) in the same transaction. False if it was not."""
        assert to in STATUSES, to
        values = {"status": to, **{k: _column(v) for k, v in fields.items()}}
        sets = ", ".join(f"{key} = ?" for key in values)
        marks = ", ".join("?" * len(only_from))
        with self._transaction() as db:
            changed = db.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND status IN ({marks})",
                (*values.values(), job_id, *only_from),
            ).rowcount
            if changed and event is not None:
                _insert_event(db, job_id, *event)
        return bool(changed)

    def update_job(self, job_id: str, **fields) -> None:
        sets = ", ".join(f"{key} = ?" for key in fields)
        with self._transaction() as db:
            db.execute(
                f"UPDATE jobs SET {sets} WHERE id = ?",
                (*(_column(v) for v in fields.values()), job_id),
            )

    def run_dir(self, job_id: str) -> Path:
        return self.runs_dir / job_id

    # -- events and checkpoints -------------------------------------------------------

    def add_event(self, job_id: str, level: str, message: str, type_="message", data=None):
        with self._transaction() as db:
            _insert_event(db, job_id, level, message, type_, data)

    def list_events(
        self, job_id: str, *, after: str | None = None, limit: int = 20
    ) -> tuple[list[dict], bool]:
        """Newest first, as OpenAI lists them."""
        rows = self._page("events", "job_id = ?", [job_id], after, limit)
        return [_event(r) for r in rows[:limit]], len(rows) > limit

    def drop_metrics_after(self, job_id: str, step: int) -> int:
        """Forget the step metrics past `step` (logged by a run that died after its last
        checkpoint; the resumed run logs those steps again). Returns how many."""
        with self._transaction() as db:
            return db.execute(
                "DELETE FROM events WHERE job_id = ? AND type = 'metrics' "
                "AND json_extract(data, '$.step') > ?",
                (job_id, step),
            ).rowcount

    def add_checkpoint(self, job_id: str, step: int, metrics: dict, name: str) -> bool:
        """Record the checkpoint of `step` once; False if it was already recorded."""
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT OR IGNORE INTO checkpoints (id, job_id, created_at, step, metrics, name) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (new_id("ftckpt"), job_id, now(), step, json.dumps(metrics), name),
            )
            return cursor.rowcount == 1

    def list_checkpoints(
        self, job_id: str, *, after: str | None = None, limit: int = 10
    ) -> tuple[list[dict], bool]:
        rows = self._page("checkpoints", "job_id = ?", [job_id], after, limit)
        return [_checkpoint(r) for r in rows[:limit]], len(rows) > limit

    def _page(self, table: str, where: str, args: list, after: str | None, limit: int):
        """Rows newest first, after the row whose id is `after`; one extra row tells
        whether more follow. An unknown `after`, or one outside `where` (another tenant's
        id, another job's event), gives an empty page: it must read as one that does not
        exist."""
        if after is not None:
            where = f"{where} AND seq < (SELECT seq FROM {table} WHERE id = ? AND {where})"
            args = [*args, after, *args]
        return self._query(
            f"SELECT * FROM {table} WHERE {where} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)
        )


def _storable(value) -> bool:
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _insert_event(db, job_id: str, level: str, message: str, type_="message", data=None):
    db.execute(
        "INSERT INTO events (id, job_id, created_at, level, message, type, data) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (new_id("ftevent"), job_id, now(), level, message, type_, _column(data)),
    )


def _column(value):
    """dicts and lists are stored as JSON text."""
    return json.dumps(value) if isinstance(value, dict | list | tuple) else value


def _file(row: sqlite3.Row) -> FileRecord:
    return FileRecord(
        row["id"], row["tenant"], row["filename"], row["purpose"], row["bytes"], row["created_at"]
    )


def _job(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        id=row["id"],
        tenant=row["tenant"],
        created_at=row["created_at"],
        spec=json.loads(row["spec"]),
        status=row["status"],
        fine_tuned_model=row["fine_tuned_model"],
        error=json.loads(row["error"]) if row["error"] else None,
        finished_at=row["finished_at"],
        trained_tokens=row["trained_tokens"],
        result_files=tuple(json.loads(row["result_files"])),
    )


def _event(row: sqlite3.Row) -> dict:
    """OpenAI's `fine_tuning.job.event` object."""
    return {
        "id": row["id"],
        "object": "fine_tuning.job.event",
        "created_at": row["created_at"],
        "level": row["level"],
        "message": row["message"],
        "type": row["type"],
        "data": json.loads(row["data"]) if row["data"] else {},
    }


def _checkpoint(row: sqlite3.Row) -> dict:
    """OpenAI's `fine_tuning.job.checkpoint` object."""
    return {
        "id": row["id"],
        "object": "fine_tuning.job.checkpoint",
        "created_at": row["created_at"],
        "fine_tuning_job_id": row["job_id"],
        "fine_tuned_model_checkpoint": row["name"],
        "step_number": row["step"],
        "metrics": json.loads(row["metrics"]),
    }


def _own(root: Path) -> int:
    """Hold an exclusive lock on the jobs dir for as long as this store is open (the
    kernel drops it when the process dies): two servers on one jobs dir would both run
    and checkpoint the same jobs, and each would delete the other's fresh uploads."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JobsDirBusy(
            f"another symbiont serve is using --jobs-dir {root}: stop it, or give this "
            "server a jobs dir of its own"
        ) from None
    return fd


class JobsDirBusy(RuntimeError):
    """The jobs dir is held by another open store (another server)."""
