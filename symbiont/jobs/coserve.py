"""Co-serving (FlexLLM): fine-tuning tokens fitted into the serving engine's iterations so
that inference keeps its time-per-output-token target (`symbiont serve --slo-tpot-ms`).

Each engine iteration schedules inference first (c tokens). Then, if a fine-tuning job
waits for work, the engine thread hands it a slot of s* fine-tuning tokens, the largest s
with f(c, s) <= SLO, and waits until the worker has run them: one window of the job's
token-level step (`symbiont.jobs.windows.WindowedStep`), forward or backward. Only the
worker touches the job's model and only the engine thread touches the `Engine`, so the
engine stays single-threaded (serve/engine.py); the HTTP event loop never waits on
either. Every decode token of the iteration is delivered after its slot, so an
iteration's time is the time per output token the clients see.

f is `CostModel`: iteration seconds, linear in c and in the forward and backward
fine-tuning tokens, with a fixed cost per pass (Python, the per-window key/value cache).
It is profiled when a job starts, with a few timed probes on the job's own model
(`profile`), and refitted by least squares every `refit_every` iterations over the probes
and the last `window` measured iterations (the whole iteration, hand-off included).

A forward window is cut no larger than the tokens whose backward also fits the SLO at the
same load, so its backward can run in a later slot; while the engine has no inference to
run (no iteration for two SLOs), the worker takes slots of its own, budgeted at c = 0, back
to back. Evaluation and checkpoints run outside slots, behind the inference-first gate of
symbiont/jobs/priority.py.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from symbiont.jobs.windows import WindowedStep
from symbiont.train.config import TrainConfig
from symbiont.train.data import Example, collate
from symbiont.train.loop import TrainResult, _Run

FEATURES = (
    "base",  # per iteration
    "inference_token",
    "forward_pass",  # once per slot with forward fine-tuning tokens
    "forward_token",
    "backward_pass",
    "backward_token",
)
MIN_TOKEN_COST_S = 1e-9  # a fitted per-token cost never drops to 0 (the budget stays finite)
HANDOFF_TIMEOUT_S = 30.0  # the engine waits at most this long for a slot (a stuck worker)


class CostModel:
    """f(c, s_forward, s_backward): seconds of one engine iteration with c inference tokens
    and that many fine-tuning tokens, least squares over probes and recent iterations."""

    def __init__(
        self, coefficients: Sequence[float] | None = None, window: int = 256, refit_every: int = 16
    ):
        if window < 1 or refit_every < 0:
            raise ValueError(
                f"window must be >= 1 and refit_every >= 0, got {window} and {refit_every}"
            )
        self.coefficients = list(coefficients) if coefficients is not None else [0.0] * 6
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"a cost model has {len(FEATURES)} coefficients: {FEATURES}")
        self.probes: list[tuple[list[float], float]] = []  # kept: they span the features
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.refit_every = refit_every  # 0: never refit (coefficients given)
        self._since_fit = 0
        self._lock = threading.Lock()  # samples come from the engine and the worker

    @staticmethod
    def features(c: int, forward: int = 0, backward: int = 0) -> list[float]:
        return [1.0, c, float(forward > 0), forward, float(backward > 0), backward]

    def predict(self, c: int, forward: int = 0, backward: int = 0) -> float:
        x = self.features(c, forward, backward)
        return sum(w * v for w, v in zip(self.coefficients, x, strict=True))

    def add(self, c: int, forward: int, backward: int, seconds: float, probe: bool = False):
        with self._lock:
            sample = (self.features(c, forward, backward), seconds)
            (self.probes.append if probe else self.recent.append)(sample)
            self._since_fit += 1
            due = self.refit_every and self._since_fit >= self.refit_every
        if due:
            self.refit()

    def refit(self) -> None:
        """Least squares over probes and recent iterations, coefficients kept >= 0: a
        feature whose coefficient comes out negative is fixed at 0 and the rest refitted."""
        with self._lock:
            samples = self.probes + list(self.recent)
            self._since_fit = 0
        if len(samples) < 2:
            return
        x = torch.tensor([s[0] for s in samples], dtype=torch.float64)  # [n, features]
        y = torch.tensor([s[1] for s in samples], dtype=torch.float64)  # [n]
        active = [j for j in range(len(FEATURES)) if x[:, j].abs().sum() > 0]
        while active:
            solution = torch.linalg.lstsq(x[:, active], y.unsqueeze(1)).solution.squeeze(1)
            negative = [j for j, w in zip(active, solution.tolist(), strict=True) if w < 0]
            if not negative:
                break
            active = [j for j in active if j not in negative]
        fitted = [0.0] * len(FEATURES)
        for j, w in zip(active, solution.tolist() if active else [], strict=True):
            fitted[j] = w
        self.coefficients = fitted

    def budget(self, c: int, slo_s: float, backward: bool, limit: int) -> int:
        """The largest s in [0, limit] fine-tuning tokens (of the backward pass, or of the
        forward) with f(c, s) <= slo_s."""
        base, per_c, f_pass, f_token, b_pass, b_token = self.coefficients
        fixed, per = (b_pass, b_token) if backward else (f_pass, f_token)
        room = slo_s - base - per_c * c - fixed
        if room <= 0:
            return 0
        s = min(limit, int(room / max(per, MIN_TOKEN_COST_S)))
        cost = (lambda n: self.predict(c, 0, n)) if backward else (lambda n: self.predict(c, n))
        while s > 0 and cost(s) > slo_s:  # rounding at the boundary
            s -= 1
        return max(s, 0)

    def forward_budget(self, c: int, slo_s: float, limit: int) -> int:
        """Forward tokens whose forward and (later) backward each fit the SLO at load c."""
        return min(self.budget(c, slo_s, False, limit), self.budget(c, slo_s, True, limit))


@dataclass(frozen=True)
class Slot:
    """Fine-tuning work granted after one engine iteration (or while the engine idles)."""

    inference_tokens: int  # c of the iteration it follows (0 when the engine is idle)
    forward_tokens: int  # budget of forward tokens (one window)
    backward_tokens: int  # budget of backward tokens (whole windows)
    from_engine: bool


@dataclass(frozen=True)
class SlotRecord:
    slot: Slot
    forward_tokens: int  # tokens actually run
    backward_tokens: int
    seconds: float


@dataclass(frozen=True)
class _Need:
    backward: bool
    tokens: int  # smallest grant that lets the step progress


class CoServe:
    """The hand-off between the engine thread (`after_iteration`, the engine's
    `iteration_hook`) and the fine-tuning worker (`run_step`)."""

    def __init__(
        self,
        slo_s: float,
        cost: CostModel | None = None,
        idle_s: float | None = None,
        max_tokens: int = 4096,
    ):
        if slo_s <= 0:
            raise ValueError(f"the time-per-output-token target must be > 0 s, got {slo_s}")
        self.slo_s = slo_s
        self.cost = cost or CostModel()
        # no iteration for this long (an inference iteration alone takes < slo_s): idle
        self.idle_s = 2 * slo_s if idle_s is None else idle_s
        self.max_tokens = max_tokens  # most fine-tuning tokens in one slot
        self.history: collections.deque[SlotRecord] = collections.deque(maxlen=10_000)
        self.in_slot = False  # the worker is running granted work (tests watch it)
        self._cond = threading.Condition()
        self._need: _Need | None = None  # what the waiting worker needs, if one waits
        self._granted: Slot | None = None
        self._slot_done = threading.Event()
        self._used = (0, 0)
        self._last_iteration = float("-inf")

    # -- the engine thread --------------------------------------------------------------

    def after_iteration(self, c: int, seconds: float) -> None:
        """Called by the engine after an iteration of c inference tokens that took
        `seconds`: grant the waiting worker its budget and wait until it has run it."""
        started = time.perf_counter()
        with self._cond:
            slot = self._slot_for(c, self._need) if self._need is not None else None
            if slot is None:
                self._last_iteration = time.monotonic()
            else:
                self._need, self._granted = None, slot
                self._slot_done.clear()
                self._cond.notify_all()
        if slot is None:
            self.cost.add(c, 0, 0, seconds)
            return
        self._slot_done.wait(HANDOFF_TIMEOUT_S)
        forward, backward = self._used
        self.cost.add(c, forward, backward, seconds + time.perf_counter() - started)
        with self._cond:
            self._last_iteration = time.monotonic()

    def _slot_for(self, c: int, need: _Need, from_engine: bool = True) -> Slot | None:
        limit = self.max_tokens
        if need.backward:
            budget = self.cost.budget(c, self.slo_s, True, limit)
            slot = Slot(c, 0, budget, from_engine)
        else:
            budget = self.cost.forward_budget(c, self.slo_s, limit)
            slot = Slot(c, budget, 0, from_engine)
        if budget >= need.tokens:
            return slot
        if from_engine:
            return None  # no room after this iteration's inference: the job waits
        # no inference to protect: the step progresses by at least one window
        if need.backward:
            return Slot(c, 0, need.tokens, False)
        return Slot(c, need.tokens, 0, False)

    # -- the worker thread --------------------------------------------------------------

    def run_step(self, step: WindowedStep, check: Callable[[], None] = lambda: None) -> None:
        """Run a whole training step, window by window, each in a granted slot."""
        while not step.done:
            slot = self._take_slot(self._need_of(step), check)
            started = time.perf_counter()
            forward = backward = 0
            self.in_slot = True
            try:
                forward, backward = _spend(step, slot)
            finally:
                self.in_slot = False
                seconds = time.perf_counter() - started
                self.history.append(SlotRecord(slot, forward, backward, seconds))
                if slot.from_engine:
                    self._used = (forward, backward)
                    with self._cond:  # the engine was busy until now: not idle
                        self._last_iteration = time.monotonic()
                    self._slot_done.set()
                else:
                    self.cost.add(0, forward, backward, seconds)

    @staticmethod
    def _need_of(step: WindowedStep) -> _Need:
        if step.forward_done:
            return _Need(True, step.next_backward_tokens())
        return _Need(False, step.batch)  # one position of every row

    def _take_slot(self, need: _Need, check: Callable[[], None]) -> Slot:
        with self._cond:
            self._need = need
            try:
                while self._granted is None:
                    idle_for = time.monotonic() - self._last_iteration
                    if idle_for >= self.idle_s:
                        return self._slot_for(0, need, from_engine=False)
                    self._cond.wait(min(self.idle_s - idle_for, 0.05))
                    if self._granted is None:
                        check()  # a cancel or a stop ends the wait
                slot, self._granted = self._granted, None
                return slot
            finally:
                self._need = None


def _spend(step: WindowedStep, slot: Slot) -> tuple[int, int]:
    """Run the slot's work: one forward window, or as many backward windows as fit."""
    if not step.forward_done:
        return step.forward(max(1, slot.forward_tokens // step.batch)), 0
    backward = 0
    while not step.done and backward + step.next_backward_tokens() <= slot.backward_tokens:
        backward += step.backward()
    return 0, backward


# -- start-up profile -----------------------------------------------------------------------


def profile(
    model, cost: CostModel, vocab: int, sizes: Sequence[int] = (4, 16, 64), repeats: int = 2
) -> None:
    """A few timed probes on `model` (the job's PEFT model): inference-like forwards of c
    tokens without gradients, and windowed forward and backward passes of s tokens. Leaves
    no gradient behind and reseeds nothing (training seeds itself afterwards)."""
    generator = torch.Generator().manual_seed(0)
    length = sum(sizes)
    ids = torch.randint(3, vocab, (1, length), generator=generator)  # [1, length]
    for _ in range(repeats):
        for c in sizes:
            with torch.no_grad():
                started = time.perf_counter()
                model(input_ids=ids[:, :c])
                cost.add(c, 0, 0, time.perf_counter() - started, probe=True)
        step = WindowedStep(model, ids, ids.clone())
        for s in sizes:
            started = time.perf_counter()
            step.forward(s)
            cost.add(0, s, 0, time.perf_counter() - started, probe=True)
        while not step.done:
            started = time.perf_counter()
            s = step.backward()
            cost.add(0, 0, s, time.perf_counter() - started, probe=True)
    model.zero_grad(set_to_none=True)
    cost.refit()


# -- the training loop with windowed steps -------------------------------------------------


def train_coserved(
    model,
    examples: Sequence[Example],
    config: TrainConfig,
    out: str | Path,
    *,
    coserve: CoServe,
    pad_token_id: int,
    check: Callable[[], None] = lambda: None,
    eval_examples: Sequence[Example] = (),
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """`symbiont.train.train` with every micro-batch run as a token-level windowed step in
    the slots `coserve` grants; same checkpoints, metrics and resume."""
    run = _WindowedRun(model, list(examples), list(eval_examples), config, Path(out), pad_token_id)
    run.coserve, run.check = coserve, check
    run.start(resume)
    return run.loop(progress, on_step)


class _WindowedRun(_Run):
    coserve: CoServe
    check: Callable[[], None]

    def _optimizer_step(self) -> tuple[float, int]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, tokens)."""
        accum, total_loss, tokens = self.config.grad_accum, 0.0, 0
        for micro in range(accum):
            batch = collate(self._batch(self.state.step * accum + micro), self.pad)
            step = WindowedStep(
                self.model,
                batch["input_ids"],
                batch["labels"],
                batch["attention_mask"],
                scale=1.0 / accum,
            )
            self.coserve.run_step(step, self.check)
            total_loss += step.loss.item()
            tokens += int(batch["attention_mask"].sum())
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss / accum, tokens
