"""Adapters served from a folder on demand: Chameleon's adapter cache, in three tiers.

Every subfolder of `--adapter-dir` that holds a PEFT adapter, or a compressed full
fine-tune (a `symbiont delta compress` folder, recognised by its manifest; method
"delta", applied as `--delta-mode` says, `symbiont.serve.deltas`), is served under its
folder name. Each adapter or delta is in one tier (its `state`):

- `disk`: found by a scan, its config and weight headers checked; weights not read.
- `loading` -> `host`: the first request that names it starts one background load (a
  thread of this module, never the engine's step thread); requests arriving meanwhile
  wait on the same load. The validated weights then stay in host memory.
- `resident`: copied into a slot of the engine's batched weight stacks
  (`AdapterRegistry`), at most `max_adapters` (`--max-loras`) slots, where a forward uses
  it. Copying a host adapter into a slot happens on the engine thread at admission.
- `failed`: with the reason (bad config, bad or missing weights, another base, a rank
  over `--max-lora-rank`, a name with `/`, `..` or NUL, a symlink out of the folder; for
  a delta: made for another base or model (manifest), a tampered or truncated file);
  its requests are refused naming it, the others are served. Once its files change, the
  next `scan` tries it again.

Reference counts: `reserve` counts every queued or running request. An adapter with a
reference never leaves host memory. It leaves its slot only when no running sequence
uses it; an adapter with queued requests is evicted from a slot only after every
unreferenced one (its weights stay in host memory, so it comes back with one copy).
Adapters of queued requests are prefetched: `reserve` starts their load at once, while
others run.

Deltas also count against `--max-deltas` (DeltaZip's N resident deltas, `--delta` ones
included): placing one more evicts an idle resident delta of the folder, or waits.

Eviction (`--cache-policy`): `cost` evicts the lowest Chameleon score
`F*frequency + R*recency + S*size` (0.45 / 0.10 / 0.45), each normalised to [0, 1] over
the candidates (hits / max hits, last use between the oldest and newest, bytes / max
bytes; a large adapter is dear to reload, so it stays); `lru` evicts the least recently
used. The host tier holds at most `host_cache_bytes`, or with 0 follows idle memory: at
most half of (its own bytes + what the OS reports available), re-read at every load, so
it grows while memory is free and shrinks when the KV cache or anything else takes it.

Nothing outside the folder is read: names are checked, paths resolved, and a subfolder
that is a symlink pointing out of the folder is `failed` without being opened.

Threads: the API thread (`lookup`, `reserve`, `release`, `cards`), the loader threads
(`_load`) and the engine thread (`place`) share one lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path

from symbiont.adapters.names import CONFIG_FILE, WEIGHTS_FILE
from symbiont.serve.adapters import (
    AdapterError,
    AdapterNotFound,
    AdapterRegistry,
    AdapterWeights,
    LoraWeights,
    cached_key,
)
from symbiont.serve.config import CachePolicy, EngineConfig
from symbiont.serve.output import EngineObserver

_DELTA_FILES = ("manifest.json", "delta.safetensors", "delta.safetensors.zst")

__all__ = ["AdapterCache", "AdapterFailed", "AdapterState", "Placement", "name_problem"]

# Chameleon's cache score weights: frequency, recency, size.
SCORE_WEIGHTS = (0.45, 0.10, 0.45)
FALLBACK_HOST_BYTES = 1 << 30  # where the OS reports no available memory


class AdapterState(StrEnum):
    DISK = "disk"
    LOADING = "loading"
    HOST = "host"
    RESIDENT = "resident"
    FAILED = "failed"


class Placement(Enum):
    """What `AdapterCache.place` could do for a waiting sequence."""

    READY = "ready"  # resident; the slot is held for the sequence
    LOADING = "loading"  # still being read from disk
    NO_SLOT = "no_slot"  # in host memory, every slot is used by running sequences
    FAILED = "failed"


class AdapterFailed(AdapterError):
    """A request names an adapter of the folder that cannot be served (the reason says why)."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"adapter {name!r} cannot be served: {reason}")
        self.name = name


@dataclass(eq=False)
class CachedAdapter:
    name: str
    path: Path
    state: AdapterState = AdapterState.DISK
    reason: str | None = None  # why it failed
    method: str | None = None
    rank: int = 0
    bytes: int = 0  # weights file at scan, tensors once loaded
    hits: int = 0  # requests that named it
    last_use: float | None = None  # time.time() of the last request
    refs: int = 0  # queued or running requests
    weights: AdapterWeights | None = None  # in host memory (host and resident)
    loading: Future | None = None
    load_seconds: float | None = None
    tick: int = 0  # order of last use (recency without clock ties)
    stamp: tuple = ()  # modification times of its files when it was discovered
    stale: bool = False  # its folder changed or went while it sat in a slot: evict, forget

    def card(self) -> dict:
        return {
            "id": self.name,
            "object": "adapter",
            "source": "adapter_dir",
            "method": self.method,
            "rank": self.rank,
            "bytes": self.bytes,
            "state": str(self.state),
            "reason": self.reason,
            "hits": self.hits,
            "in_use": self.refs,
            "last_use": self.last_use,
            "load_seconds": self.load_seconds,
        }


def name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter folder, or None if it can."""
    if not name or len(name) > 255:
        return "a name must have 1 to 255 characters"
    for bad, what in (("\0", "a NUL"), ("/", "'/'"), ("\\", "'\\'"), ("..", "'..'")):
        if bad in name:
            return f"the name holds {what}; adapter names are single folder names"
    if name.startswith("."):
        return "the name starts with '.' (hidden folders are not served)"
    return None


class AdapterCache:
    def __init__(
        self,
        registry: AdapterRegistry,
        root: str | os.PathLike,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        load_threads: int = 2,
    ):
        self.registry = registry
        self.root = Path(os.path.realpath(root))
        self.config = config
        self.observer = observer or EngineObserver()
        self._entries: dict[str, CachedAdapter] = {}
        self._lock = threading.RLock()
        self._ticks = 0
        self.failures = 0  # bumped whenever an adapter fails (the engine then fails its requests)
        self.stale = False  # some resident adapter's folder changed or went (`drop_stale`)
        self.wake: Callable[[], None] | None = None  # called when a load ends (engine thread)
        self._pool = ThreadPoolExecutor(load_threads, thread_name_prefix="symbiont-adapter-load")

    # -- discovery (any thread) --------------------------------------------------------

    def scan(self) -> None:
        """Discover subfolders not seen yet; forget unused ones whose folder is gone, and
        failed ones whose files changed since (fixed folders are retried)."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError as err:
            raise AdapterError(f"cannot list --adapter-dir {self.root}: {err}") from err
        present = set(names)
        with self._lock:
            for name, entry in list(self._entries.items()):
                gone = name not in present
                changed = not gone and _stamp(entry.path) != entry.stamp
                if entry.refs or not (gone or changed) or entry.state is AdapterState.LOADING:
                    continue  # in use, unchanged, or being read: looked at again next scan
                if entry.state is AdapterState.RESIDENT:
                    entry.stale = self.stale = True  # its slot is the engine thread's
                else:  # on disk, failed or in host memory: forgotten, found again if there
                    del self._entries[name]
        for name in names:
            if name not in self._entries and not name.startswith("."):
                self._discover(name)

    def drop_stale(self) -> None:
        """Engine thread: evict and forget idle resident adapters whose folder changed
        or went (scan marked them), so the next request reads the folder again."""
        if not self.stale:  # the common case: one attribute read per iteration
            return
        with self._lock:
            self.stale = False
            for name, entry in list(self._entries.items()):
                if not entry.stale or entry.state is not AdapterState.RESIDENT:
                    continue
                if entry.refs:
                    self.stale = True  # wanted: `place` reloads it once its slot is idle
                    continue
                self._evict_resident(entry)
                del self._entries[name]

    def _reload_stale(self, entry: CachedAdapter) -> None:
        """Engine thread, under the lock: a resident adapter whose folder changed, with no
        sequence in its slot, is evicted and read again from its folder."""
        self._evict_resident(entry)
        entry.weights, entry.stale, entry.stamp = None, False, _stamp(entry.path)
        problem = self._inspect(entry)  # method, rank and size of the new files
        if problem is not None:
            entry.state, entry.reason = AdapterState.FAILED, problem
            self.failures += 1
            return
        entry.state = AdapterState.LOADING
        entry.loading = self._pool.submit(self._load, entry)

    def lookup(self, name: str) -> CachedAdapter | None:
        """The folder's adapter `name` (discovered now if it appeared since the scan), or
        None if the folder holds no such adapter."""
        with self._lock:
            entry = self._entries.get(name)
        if entry is not None:
            return entry
        if name_problem(name) is not None:
            return None  # never turned into a path
        return self._discover(name)

    def _discover(self, name: str) -> CachedAdapter | None:
        path = self.root / name
        entry = CachedAdapter(name, path)
        if not os.path.islink(path) and not os.path.isdir(path):
            return None  # files and missing names are not adapters: not served, not listed
        problem = name_problem(name) or self._outside(path)
        if problem is None:
            entry.method = "delta" if self._is_delta(path) else None
            if entry.method is None and not (path / CONFIG_FILE).is_file():
                return None  # neither a PEFT config nor a delta manifest: not served, not listed
            problem = self._inspect(entry)
        entry.stamp = _stamp(path)
        if problem is not None:
            entry.state, entry.reason = AdapterState.FAILED, problem
        with self._lock:
            return self._entries.setdefault(name, entry)

    def _outside(self, path: Path) -> str | None:
        real = os.path.realpath(path)
        if os.path.commonpath([self.root, real]) != str(self.root) or real == str(self.root):
            return "its folder is a symlink pointing outside --adapter-dir; it was not read"
        return None

    @staticmethod
    def _is_delta(path: Path) -> bool:
        from symbiont.serve.deltas import is_delta_folder

        return not (path / CONFIG_FILE).exists() and is_delta_folder(path)

    def _deltas(self):
        from symbiont.serve.deltas import DeltaServer

        return DeltaServer.of(self.registry)

    def _inspect(self, entry: CachedAdapter) -> str | None:
        if entry.method == "delta":
            try:
                entry.bytes = self._deltas().inspect(entry.path)
            except AdapterError as err:
                return str(err)
            return None
        try:
            spec = self.registry.inspect(entry.path)
        except AdapterError as err:
            return str(err)
        entry.method = "dora" if getattr(spec.config, "use_dora", False) else spec.method
        entry.rank = max(spec.ranks.values(), default=spec.rank or 0)
        entry.bytes = spec.size_bytes
        return None

    # -- requests (API thread) ---------------------------------------------------------

    def reserve(self, name: str, count: bool = True) -> Future:
        """Hold `name` for one request and start its load if it is on disk; the future
        is done once it is in memory (it raises AdapterFailed if the load failed).
        `count`: the request counts as a hit (not when its server already counted it)."""
        entry = self.lookup(name)
        if entry is None:
            raise AdapterNotFound(_not_found(name))
        with self._lock:
            if entry.state is AdapterState.FAILED:
                raise AdapterFailed(name, entry.reason or "it failed to load")
            if entry.stale and not os.path.isdir(entry.path):
                raise AdapterNotFound(_not_found(name))  # its folder was removed
            entry.refs += 1
            if count:
                entry.hits += 1
                entry.last_use = time.time()
                entry.tick = self._tick()
                self._count_lookup(entry.state)
            if entry.state is AdapterState.DISK:
                entry.state = AdapterState.LOADING
                entry.loading = self._pool.submit(self._load, entry)
            if entry.loading is not None:
                return entry.loading
        done: Future = Future()
        done.set_result(entry)
        return done

    def release(self, name: str) -> None:
        """One request on `name` finished (or was refused after `reserve`)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.refs -= 1
            assert entry.refs >= 0, f"adapter {name!r} released more often than reserved"
            self._trim_host()

    def _count_lookup(self, state: AdapterState) -> None:
        observe = self.observer.on_adapter_cache
        observe("resident", state is AdapterState.RESIDENT)
        if state is not AdapterState.RESIDENT:
            observe("host", state is AdapterState.HOST)

    def _tick(self) -> int:
        self._ticks += 1
        return self._ticks

    # -- loading (loader threads) ------------------------------------------------------

    def _load(self, entry: CachedAdapter) -> CachedAdapter:
        start = time.perf_counter()
        try:
            problem = self._outside(entry.path)  # the folder may have changed since the scan
            if problem is not None:
                raise AdapterError(problem)
            if entry.method == "delta":
                weights = self._deltas().parse(entry.path, self.config.delta_mode)
            else:
                weights = self.registry.parse(entry.path)
        except Exception as err:  # noqa: BLE001 - any failure marks this adapter only
            reason = str(err) if isinstance(err, AdapterError) else f"{type(err).__name__}: {err}"
            self._fail(entry, reason)
            self.observer.on_adapter_load(time.perf_counter() - start, False)
            self._woken()
            raise AdapterFailed(entry.name, reason) from None
        seconds = time.perf_counter() - start
        with self._lock:
            entry.weights, entry.state = weights, AdapterState.HOST
            entry.bytes, entry.load_seconds = weights_bytes(weights), seconds
            entry.rank = weights.rank
            entry.loading = None
            self._trim_host()
        self.observer.on_adapter_load(seconds, True)
        self._woken()
        return entry

    def _woken(self) -> None:
        if self.wake is not None:
            self.wake()

    def _fail(self, entry: CachedAdapter, reason: str) -> None:
        stamp = _stamp(entry.path)
        with self._lock:
            entry.state, entry.reason, entry.loading = AdapterState.FAILED, reason, None
            entry.stamp = stamp
            self.failures += 1

    # -- slots (engine thread) ---------------------------------------------------------

    def place(self, name: str, evict: bool = True) -> tuple[Placement, int]:
        """Make `name` resident and hold its slot for one sequence: (READY, slot), or why
        not yet. Evicts a resident adapter no running sequence uses when slots are full."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state is AdapterState.FAILED:
                return Placement.FAILED, 0
            key = cached_key(name)
            if (
                entry.stale
                and entry.state is AdapterState.RESIDENT
                and not self.registry.users(key)
            ):
                self._reload_stale(entry)  # its folder changed: serve the new files
                if entry.state is AdapterState.FAILED:
                    return Placement.FAILED, 0
            if entry.state in (AdapterState.DISK, AdapterState.LOADING):
                return Placement.LOADING, 0
            if entry.state is AdapterState.HOST and not self._install(entry, evict):
                return Placement.NO_SLOT, 0
            return Placement.READY, self.registry.acquire(cached_key(name))

    def evict_idle(self) -> bool:
        """Evict one resident adapter no running sequence uses (for an adapter loaded by
        name); False when there is none."""
        with self._lock:
            victim = self._resident_victim()
            if victim is None:
                return False
            self._evict_resident(victim)
            return True

    def is_delta(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and entry.method == "delta"

    def needs_delta_slot(self, name: str) -> bool:
        """Whether placing `name` waits for a resident delta to leave (a delta, with
        `--max-deltas` of them resident) rather than for any slot."""
        limit = self.config.max_deltas
        return self.is_delta(name) and limit is not None and self._deltas().num_resident >= limit

    def _install(self, entry: CachedAdapter, evict: bool) -> bool:
        is_delta = entry.method == "delta"
        limit = self.config.max_deltas
        if is_delta and limit is not None and self._deltas().num_resident >= limit:
            victim = self._resident_victim(deltas_only=True) if evict else None
            if victim is None:
                return False  # every resident delta is in use (or pinned): wait
            self._evict_resident(victim)
        if self.registry.num_free_slots == 0:
            victim = self._resident_victim() if evict else None
            if victim is None:
                return False
            self._evict_resident(victim)
        try:
            slot = self.registry.add(cached_key(entry.name), entry.weights)
        except AdapterError as err:  # this adapter fails, not the engine's iteration
            self._fail(entry, str(err))
            return False
        if is_delta:
            self._deltas().place(slot, entry.weights)
        entry.state = AdapterState.RESIDENT
        return True

    def _evict_resident(self, victim: CachedAdapter) -> None:
        key = cached_key(victim.name)
        if victim.method == "delta":
            self._deltas().evict(self.registry.info(key)["slot"])
        self.registry.remove(key)
        victim.state = AdapterState.HOST
        self.observer.on_adapter_evict("resident")

    def _resident_victim(self, deltas_only: bool = False) -> CachedAdapter | None:
        """A resident adapter no running sequence uses: unreferenced ones first."""
        idle = [
            e
            for e in self._entries.values()
            if e.state is AdapterState.RESIDENT
            and self.registry.users(cached_key(e.name)) == 0
            and (e.method == "delta" or not deltas_only)
        ]
        return self._lowest(idle)

    def _trim_host(self) -> None:
        """Drop unreferenced host-tier weights (lowest score first) down to the budget."""
        budget = self.host_budget()
        while self.host_bytes() > budget:
            idle = [e for e in self._entries.values() if e.state is AdapterState.HOST]
            victim = self._lowest([e for e in idle if e.refs == 0])
            if victim is None:
                return  # the rest is in use: never evicted
            victim.weights, victim.state = None, AdapterState.DISK
            self.observer.on_adapter_evict("host")

    def _lowest(self, candidates: list[CachedAdapter]) -> CachedAdapter | None:
        """The candidate to evict: unreferenced ones before referenced, then by policy."""
        if not candidates:
            return None
        free = [e for e in candidates if e.refs == 0] or candidates
        if self.config.cache_policy is CachePolicy.LRU:
            return min(free, key=lambda e: e.tick)
        scores = cost_scores(free)
        return min(free, key=lambda e: (scores[e.name], e.tick))

    # -- accounting --------------------------------------------------------------------

    def host_bytes(self) -> int:
        with self._lock:
            return sum(e.bytes for e in self._entries.values() if e.weights is not None)

    def host_budget(self) -> int:
        if self.config.host_cache_bytes:
            return self.config.host_cache_bytes
        available = available_memory()
        if available is None:
            return FALLBACK_HOST_BYTES
        return (self.host_bytes() + available) // 2

    def state(self, name: str) -> AdapterState | None:
        with self._lock:
            entry = self._entries.get(name)
            return None if entry is None else entry.state

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def cards(self) -> list[dict]:
        with self._lock:
            return [self._entries[n].card() for n in sorted(self._entries)]

    def failed_names(self) -> set[str]:
        with self._lock:
            return {n for n, e in self._entries.items() if e.state is AdapterState.FAILED}

    def num_in(self, state: AdapterState) -> int:
        with self._lock:
            return sum(e.state is state for e in self._entries.values())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def cost_scores(entries: list[CachedAdapter]) -> dict[str, float]:
    """Chameleon's F*frequency + R*recency + S*size per adapter, each term in [0, 1]."""
    f, r, s = SCORE_WEIGHTS
    max_hits = max(e.hits for e in entries) or 1
    max_bytes = max(e.bytes for e in entries) or 1
    oldest, newest = min(e.tick for e in entries), max(e.tick for e in entries)
    span = newest - oldest
    return {
        e.name: f * e.hits / max_hits
        + r * ((e.tick - oldest) / span if span else 1.0)
        + s * e.bytes / max_bytes
        for e in entries
    }


def weights_bytes(weights: AdapterWeights) -> int:
    if hasattr(weights, "nbytes"):  # a delta (DeltaWeights) counts what it holds
        return weights.nbytes
    total = 0
    for module in weights.modules.values():
        tensors = (module.a, module.b) if isinstance(module, LoraWeights) else (module.vector,)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def available_memory() -> int | None:
    """Bytes the OS reports available (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _stamp(path: Path) -> tuple:
    """Modification times of an adapter folder and its files (lstat: links not followed,
    nothing outside the folder is touched)."""
    stamps = []
    for part in (path, path / CONFIG_FILE, path / WEIGHTS_FILE, *(path / f for f in _DELTA_FILES)):
        try:
            stamps.append(os.lstat(part).st_mtime_ns)
        except OSError:
            stamps.append(None)
    return tuple(stamps)


def _not_found(name: str) -> str:
    return (
        f"the model {name!r} does not exist; GET /v1/models lists the base model and every "
        "adapter, GET /v1/adapters each adapter's state"
    )
