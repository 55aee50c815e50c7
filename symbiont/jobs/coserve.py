"""Co-serving (FlexLLM): fine-tuning tokens fitted into the serving engine's iterations so
that inference keeps its time-per-output-token target (`symbiont serve --slo-tpot-ms`).

Each engine iteration schedules inference first (c tokens). Then, if a fine-tuning job
waits for work, the engine thread grants it a slot, the SLO less the predicted inference
part f(c, 0), and waits until the worker has used it: windows of the job's token-level
step (`symbiont.jobs.windows.WindowedStep`), forward and then backward, as long as the cost
model says the next window still fits, so f(c, s) <= SLO for the slot's s tokens (for one
window: s* = max{s : f(c, s) <= SLO}). Only the worker touches the job's model and only
the engine thread touches the `Engine`, so the engine stays single-threaded
(serve/engine.py); the HTTP event loop never waits on either. Every token of the
iteration is delivered after its slot, so an iteration's time is the time per output
token the clients see.

f is `CostModel`: iteration seconds, linear in c and in the forward and backward
fine-tuning tokens, with a fixed cost per iteration and per window (Python, the per-window
key/value cache). It is profiled when a job starts, with a few timed probes on the job's
own model (`profile`), and refitted by least squares every `refit_every` samples over the
probes and the last `window` measured parts: each iteration's inference, and each slot
as the engine waited for it (hand-off included).

A job's steps are cut into windows of a fixed plan of positions (`plan_positions`, sized
from the cost model at the job's first start and saved in its run folder, or given), and
a slot runs whole planned windows while the next one fits, so a step's float rounding does
not depend on the load and a resumed job is bitwise the uninterrupted one. Without a plan
(`WindowedStep(plan=None)`), a forward window is cut to the room left, no larger than the
tokens whose backward fits 80% of a slot's room at the same load. A window that found no
room for 64 iterations runs anyway (a job must not be held forever; a backward window
holds its activations). While the engine has no inference to run (no iteration for two
SLOs), the worker takes slots of its own, sized at c = 0, back to back. The optimizer step
runs in the slot of the step's last window; evaluation and checkpoints run outside slots,
behind the inference-first gate of symbiont/jobs/priority.py.
"""

from __future__ import annotations

import collections
import json
import math
import os
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
    "forward_window",  # per window of the forward pass run in a slot
    "forward_token",
    "backward_window",
    "backward_token",
)
MIN_TOKEN_COST_S = 1e-9  # a fitted per-token cost never drops to 0 (the budget stays finite)
BACKWARD_HEADROOM = 0.8  # a forward window's backward is planned within this share of the SLO
OUTLIER_SHARE = 0.1  # samples a refit leaves out: those the first fit explains worst
ERROR_WINDOW = 64  # engine cycles whose prediction error sets the margin
MIN_ERRORS = 8  # cycles measured before the margin applies
MAX_MARGIN = 4.0  # the SLO is never planned at less than a quarter of itself
# Cycles are planned for this quantile of their prediction error, at this share of the
# SLO. Planning for the median error at 90% (a request's TPOT is a mean over its
# iterations) gave the job more room but 89% attainment at 4 req/s on the loaded 2-core
# machine (BENCHMARKS.md, issue 15); the 90th percentile keeps >= 90%
MARGIN_QUANTILE = 0.9
PLANNED_SHARE = 1.0
MAX_DECLINES = 64  # iterations a backward window may wait for room before it runs anyway
HANDOFF_TIMEOUT_S = 30.0  # the engine waits at most this long for a slot (a stuck worker)
PLAN_SHARE = 0.5  # a planned window (forward or backward) fits this share of the idle room
PLAN_SLACK = 0.1  # a planned window may exceed that size by this share (whole windows)
PLAN_FILE = "coserve_plan.json"  # in the job's run folder: the plan a resume reuses


class CostModel:
    """f(c, s_forward, s_backward): seconds of one engine iteration with c inference tokens
    and that many fine-tuning tokens, fitted by least squares over probes and recent
    iterations.

    The two parts are measured apart, as they run one after the other: the inference
    part of an iteration (`add(c, 0, 0, seconds)`) and the fine-tuning slot after it with
    its hand-off (`add(0, forward, backward, seconds)`); f is their sum. Fitting the parts
    apart keeps the load and the slot sizes, which move together, from blurring each
    other's costs."""

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
    def features(
        c: int, forward: int = 0, backward: int = 0, windows: tuple[int, int] | None = None
    ) -> list[float]:
        """windows: (forward, backward) windows the tokens came in (default: one each)."""
        nf, nb = windows if windows is not None else (int(forward > 0), int(backward > 0))
        return [1.0, c, nf, forward, nb, backward]

    def predict(
        self, c: int, forward: int = 0, backward: int = 0, windows: tuple[int, int] | None = None
    ) -> float:
        x = self.features(c, forward, backward, windows)
        return sum(w * v for w, v in zip(self.coefficients, x, strict=True))

    def slot_cost(self, forward: int, backward: int, windows: tuple[int, int]) -> float:
        """Seconds of a slot's fine-tuning part alone."""
        return self.predict(0, forward, backward, windows) - self.coefficients[0]

    def add(
        self,
        c: int,
        forward: int,
        backward: int,
        seconds: float,
        probe: bool = False,
        windows: tuple[int, int] | None = None,
    ) -> None:
        """One measured part: an iteration's inference (forward = backward = 0), or a
        fine-tuning slot (c = 0)."""
        if c and (forward or backward):
            raise ValueError("record an iteration's inference and its slot as two samples")
        x = self.features(c, forward, backward, windows)
        if forward or backward:
            x[0] = 0.0  # a slot's cost has no per-iteration part
        with self._lock:
            (self.probes.append if probe else self.recent.append)((x, seconds))
            self._since_fit += 1
            due = self.refit_every and self._since_fit >= self.refit_every
        if due:
            self.refit()

    def refit(self) -> None:
        """Least squares over probes and recent parts, coefficients kept >= 0 (a feature
        whose coefficient comes out negative is fixed at 0 and the rest refitted), then once
        more without the samples the first fit explains worst (a stall of the machine or
        of the GIL is not a cost of the work)."""
        with self._lock:
            samples = self.probes + list(self.recent)
            self._since_fit = 0
        if len(samples) < 2:
            return
        x = torch.tensor([s[0] for s in samples], dtype=torch.float64)  # [n, features]
        y = torch.tensor([s[1] for s in samples], dtype=torch.float64)  # [n]
        fitted = _nonnegative_lstsq(x, y)
        residual = (x @ fitted - y).abs()
        keep = residual <= torch.quantile(residual, 1 - OUTLIER_SHARE)
        if keep.sum() >= 2:
            fitted = _nonnegative_lstsq(x[keep], y[keep])
        self.coefficients = fitted.tolist()

    def room(self, c: int, slo_s: float) -> float:
        """Seconds left for fine-tuning in an iteration of c inference tokens."""
        return slo_s - self.predict(c)

    def budget(self, c: int, slo_s: float, backward: bool, limit: int) -> int:
        """s*: the largest s in [0, limit] fine-tuning tokens, in one window of the backward
        pass or of the forward, with f(c, s) <= slo_s."""
        return self.window_tokens(self.room(c, slo_s), backward, limit)

    def window_tokens(self, room_s: float, backward: bool, limit: int) -> int:
        """The most tokens one window (of the backward pass, or the forward) runs in room_s."""
        _, _, f_window, f_token, b_window, b_token = self.coefficients
        fixed, per = (b_window, b_token) if backward else (f_window, f_token)
        if room_s - fixed <= 0:
            return 0
        s = min(limit, int((room_s - fixed) / max(per, MIN_TOKEN_COST_S)))

        def cost(n: int) -> float:
            return self.slot_cost(0, n, (0, 1)) if backward else self.slot_cost(n, 0, (1, 0))

        while s > 0 and cost(s) > room_s:  # rounding at the boundary
            s -= 1
        return max(s, 0)

    def forward_budget(self, c: int, slo_s: float, limit: int) -> int:
        """Forward tokens whose forward fits the SLO at load c, and whose backward (later)
        fits BACKWARD_HEADROOM of it, so a backward still fits when the load or the fitted
        costs have moved a little meanwhile."""
        backward = self.window_tokens(self.room(c, slo_s) * BACKWARD_HEADROOM, True, limit)
        return min(self.budget(c, slo_s, False, limit), backward)


def _nonnegative_lstsq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """argmin |x w - y| with w >= 0 by dropping negative features; x [n, k], y [n] -> [k]."""
    fitted = torch.zeros(x.shape[1], dtype=x.dtype)
    active = [j for j in range(x.shape[1]) if x[:, j].abs().sum() > 0]
    while active:
        solution = torch.linalg.lstsq(x[:, active], y.unsqueeze(1)).solution.squeeze(1)
        if (solution >= 0).all():
            fitted[active] = solution
            break
        active = [j for j, w in zip(active, solution.tolist(), strict=True) if w >= 0]
    return fitted


@dataclass(frozen=True)
class Slot:
    """Fine-tuning time granted after one engine iteration (or while the engine idles)."""

    inference_tokens: int  # c of the iteration it follows (0 when the engine is idle)
    target_s: float  # the iteration time planned for: the SLO over the prediction error
    room_s: float  # target_s less the predicted inference part: f(c, s) <= target_s in it
    from_engine: bool
    forced: bool = False  # its first window runs even if it does not fit (see MAX_DECLINES)


@dataclass(frozen=True)
class SlotRecord:
    slot: Slot
    forward_tokens: int  # tokens run, and the windows they came in
    backward_tokens: int
    windows: tuple[int, int]  # (forward, backward)
    predicted_s: float  # the fine-tuning part as the cost model priced it
    seconds: float
    finish_s: float = 0.0  # of `seconds`: the optimizer step run after the last window


@dataclass(frozen=True)
class _Need:
    backward: bool
    tokens: int  # the smallest window that lets the step progress
    planned: bool = False  # a planned window: exactly these tokens, never cut
    extra_s: float = 0.0  # run with it in the same slot (the optimizer step after the last)


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
        if not (math.isfinite(slo_s) and slo_s > 0):
            raise ValueError(
                f"the time-per-output-token target must be a finite number > 0 s, got {slo_s}"
            )
        self.slo_s = slo_s
        self.cost = cost or CostModel()
        # no iteration for this long (an inference iteration alone takes < slo_s): idle
        self.idle_s = 2 * slo_s if idle_s is None else idle_s
        self.max_tokens = max_tokens  # most tokens in one window
        self.history: collections.deque[SlotRecord] = collections.deque(maxlen=10_000)
        self.in_slot = False  # the worker is running granted work (tests watch it)
        self.declines = 0  # iterations in a row the waiting window found no room
        self._cond = threading.Condition()
        self._need: _Need | None = None  # what the waiting worker needs, if one waits
        self._granted: Slot | None = None
        self._slot_done = threading.Event()
        self._used: SlotRecord | None = None
        self._last_iteration = float("-inf")
        # measured / predicted time of recent engine cycles (iteration, slot and what runs
        # between iterations): the SLO is planned over their 90th percentile
        self._errors: collections.deque[float] = collections.deque(maxlen=ERROR_WINDOW)
        self._last_return: float | None = None
        self.finish_s = 0.0  # the last measured optimizer step (`run_step`'s finish)
        self.waited_s = 0.0  # the worker's total wait for slots (benchmarks/coserve.py)

    @property
    def margin(self) -> float:
        """How much longer recent cycles took than predicted (their MARGIN_QUANTILE, at
        least 1) over PLANNED_SHARE: what the cost model misses (scheduling and delivery
        between iterations, a loaded machine) comes out of the fine-tuning room, not out of
        the SLO."""
        errors = list(self._errors)
        if len(errors) < MIN_ERRORS:
            return 1.0
        errors.sort()
        typical = max(1.0, errors[int(MARGIN_QUANTILE * (len(errors) - 1))])
        return min(typical / PLANNED_SHARE, MAX_MARGIN)

    # -- the engine thread --------------------------------------------------------------

    def after_iteration(self, c: int, seconds: float) -> None:
        """Called by the engine after an iteration of c inference tokens that took
        `seconds`: grant the waiting worker its slot and wait until it has run it."""
        self.cost.add(c, 0, 0, seconds)
        with self._cond:
            slot = self._slot_for(c, self._need) if self._need is not None else None
            if slot is None:
                self._last_iteration = time.monotonic()
            else:
                self._need, self._granted, self._used = None, slot, None
                self._slot_done.clear()
                self._cond.notify_all()
        predicted = self.cost.predict(c)
        if slot is not None:
            started = time.perf_counter()
            self._slot_done.wait(HANDOFF_TIMEOUT_S)
            used = self._used
            if used is not None and (used.forward_tokens or used.backward_tokens):
                # the slot as the engine saw it, hand-off included, the optimizer step not
                # (its cost is measured apart: it is no window's)
                seconds = time.perf_counter() - started - used.finish_s
                self.cost.add(
                    0, used.forward_tokens, used.backward_tokens, seconds, windows=used.windows
                )
                predicted += used.predicted_s + used.finish_s
            with self._cond:
                self._last_iteration = time.monotonic()
        self._note_cycle(predicted)

    def _note_cycle(self, predicted: float) -> None:
        """The time since the last iteration's hook returned against its prediction."""
        now = time.perf_counter()
        last, self._last_return = self._last_return, now
        if last is None or predicted <= 0:
            return
        error = (now - last) / predicted
        if error <= MAX_MARGIN:  # longer: the engine waited for requests in between
            self._errors.append(error)

    def _slot_for(self, c: int, need: _Need, from_engine: bool = True) -> Slot | None:
        """The slot after an iteration of c tokens, if the waiting window fits in it."""
        target = self.slo_s / self.margin if from_engine else self.slo_s
        room = self.cost.room(c, target)
        if self._fits(need, room):
            self.declines = 0
            return Slot(c, target, room, from_engine)
        if from_engine and (
            (not need.backward and not need.planned) or self.declines < MAX_DECLINES
        ):
            self.declines += 1
            return None  # no room after this iteration's inference: the job waits
        # no inference to protect, or a backward or planned window (which cannot be cut)
        # waited MAX_DECLINES iterations: the step progresses by one window
        self.declines = 0
        return Slot(c, target, room, from_engine, forced=True)

    def _fits(self, need: _Need, room_s: float) -> bool:
        room_s -= need.extra_s
        if need.planned:
            return self.cost.window_tokens(room_s, need.backward, self.max_tokens) >= need.tokens
        if need.backward:
            return self.cost.window_tokens(room_s, True, self.max_tokens) >= need.tokens
        return self._forward_tokens(room_s, room_s) >= need.tokens

    def _forward_tokens(self, left_s: float, room_s: float) -> int:
        """A forward window that fits left_s, whose backward fits BACKWARD_HEADROOM of a
        whole slot's room at this load."""
        backward = self.cost.window_tokens(room_s * BACKWARD_HEADROOM, True, self.max_tokens)
        return min(self.cost.window_tokens(left_s, False, self.max_tokens), backward)

    # -- the worker thread --------------------------------------------------------------

    def run_step(
        self,
        step: WindowedStep,
        check: Callable[[], None] = lambda: None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        """Run a whole training step, window by window, in granted slots; then `finish`
        (the optimizer step) in the slot of the last window, so that it does not run
        beside an inference iteration."""
        self._finish, self._finished_s = finish, 0.0
        while not step.done:
            slot = self._take_slot(self._need_of(step), check)
            started = time.perf_counter()
            spent = (0, 0, (0, 0))
            self.in_slot = True
            self._finished_s = 0.0
            try:
                spent = self._spend(step, slot)
            finally:
                self.in_slot = False
                forward, backward, windows = spent
                record = SlotRecord(
                    slot,
                    forward,
                    backward,
                    windows,
                    self.cost.slot_cost(forward, backward, windows),
                    time.perf_counter() - started,
                    self._finished_s,
                )
                self.history.append(record)
                if slot.from_engine:
                    self._used = record
                    with self._cond:  # the engine was busy until now: not idle
                        self._last_iteration = time.monotonic()
                    self._slot_done.set()
                elif forward or backward:
                    seconds = record.seconds - record.finish_s
                    self.cost.add(0, forward, backward, seconds, windows=windows)
        if self._finish is not None:  # the step ended without its slot (no window ran)
            self._run_finish()

    def _run_finish(self) -> None:
        finish, self._finish = self._finish, None
        started = time.perf_counter()
        finish()
        self._finished_s = time.perf_counter() - started
        self.finish_s = self._finished_s

    def _spend(self, step: WindowedStep, slot: Slot) -> tuple[int, int, tuple[int, int]]:
        """Run windows while the cost model says the next one fits the slot's room: forward
        windows, then (the batch forwarded) backward windows. Returns the tokens of each
        pass and the windows they came in."""
        left, forward, backward, nf, nb = slot.room_s, 0, 0, 0, 0
        while not step.done:
            # an idle or forced slot runs its first window even if it does not fit
            may_overrun = nf + nb == 0 and (slot.forced or not slot.from_engine)
            if step.plan is not None and not step.forward_done:  # whole planned windows
                cost = self.cost.slot_cost(step.next_forward_tokens(), 0, (1, 0))
                if cost > left and not may_overrun:
                    break
                forward, nf = forward + step.forward(), nf + 1
                left -= cost
            elif not step.forward_done:
                tokens = self._forward_tokens(left, slot.room_s)
                if tokens < step.batch and not may_overrun:
                    break
                ran = step.forward(max(1, tokens // step.batch))
                forward, nf = forward + ran, nf + 1
                left -= self.cost.slot_cost(ran, 0, (1, 0))
            else:
                cost = self.cost.slot_cost(0, step.next_backward_tokens(), (0, 1))
                last = step.next_backward_tokens() == step.backward_tokens_left()
                if last and self._finish is not None:
                    cost += self.finish_s
                if cost > left and not may_overrun:
                    break
                backward, nb = backward + step.backward(), nb + 1
                left -= cost
        if step.done and self._finish is not None:
            self._run_finish()
        return forward, backward, (nf, nb)

    def _need_of(self, step: WindowedStep) -> _Need:
        planned = step.plan is not None
        if step.forward_done:
            tokens = step.next_backward_tokens()
            last = tokens == step.backward_tokens_left() and self._finish is not None
            return _Need(True, tokens, planned, self.finish_s if last else 0.0)
        if planned:
            return _Need(False, step.next_forward_tokens(), True)
        return _Need(False, step.batch)  # one position of every row

    def _take_slot(self, need: _Need, check: Callable[[], None]) -> Slot:
        started = time.perf_counter()
        try:
            return self._wait_for_slot(need, check)
        finally:
            self.waited_s += time.perf_counter() - started

    def _wait_for_slot(self, need: _Need, check: Callable[[], None]) -> Slot:
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


# -- start-up profile -----------------------------------------------------------------------


def profile(
    model,
    cost: CostModel,
    vocab: int,
    sizes: Sequence[int] = (4, 16, 64),
    repeats: int = 2,
    rows: int = 1,
) -> None:
    """A few timed probes on `model` (the job's PEFT model): inference-like forwards of c
    tokens without gradients, and windowed forward and backward passes of `rows` sequences
    of s positions (the job's micro-batch rows: a window's cost depends on its shape, not
    on its token count alone). One untimed round first (first calls allocate). Leaves no
    gradient behind and reseeds nothing (training seeds itself afterwards)."""
    generator = torch.Generator().manual_seed(0)
    length = sum(sizes)
    ids = torch.randint(3, vocab, (max(rows, 1), length), generator=generator)  # [rows, length]
    for round_ in range(repeats + 1):
        if round_ == 0:  # warm-up, not recorded
            step = WindowedStep(model, ids, ids.clone(), plan=sizes[-1])
            while not step.done:
                step.backward() if step.forward_done else step.forward()
            continue
        for c in sizes:
            with torch.no_grad():
                started = time.perf_counter()
                model(input_ids=ids[:1, :c])
                cost.add(c, 0, 0, time.perf_counter() - started, probe=True)
        step = WindowedStep(model, ids, ids.clone())
        for s in sizes:
            started = time.perf_counter()
            tokens = step.forward(s)
            cost.add(0, tokens, 0, time.perf_counter() - started, probe=True)
        while not step.done:
            started = time.perf_counter()
            s = step.backward()
            cost.add(0, 0, s, time.perf_counter() - started, probe=True)
    model.zero_grad(set_to_none=True)
    cost.refit()


def plan_positions(cost: CostModel, slo_s: float, rows: int, limit: int) -> int:
    """Positions per window for a job's micro-batches of `rows` sequences: the most whose
    forward and whose backward window each fit PLAN_SHARE of the room an iteration
    without inference leaves (at least 1, at most `limit`, the longest sequence), with
    at least as many tokens as make up a window's fixed cost; then evened out."""
    room = PLAN_SHARE * cost.room(0, slo_s)
    tokens = min(
        cost.window_tokens(room, False, rows * limit), cost.window_tokens(room, True, rows * limit)
    )
    # never so small that a window's fixed cost outweighs its tokens' (a profile taken on
    # a stalled machine must not cut the job into windows of a few positions)
    _, _, f_window, f_token, b_window, b_token = cost.coefficients
    floor = max(
        f_window / max(f_token, MIN_TOKEN_COST_S), b_window / max(b_token, MIN_TOKEN_COST_S)
    )
    tokens = max(tokens, math.ceil(floor))
    positions = max(1, min(limit, tokens // max(rows, 1)))
    # the longest sequence in equal windows, each at most PLAN_SLACK over `positions`
    # (60 of 64 positions: one window of 64, not two of 32, each paying the fixed cost)
    windows = max(1, math.ceil(limit / (positions * (1 + PLAN_SLACK))))
    return math.ceil(limit / windows)


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
    plan: int | None = None,
) -> TrainResult:
    """`symbiont.train.train` with every micro-batch run as a token-level windowed step in
    the slots `coserve` grants; same checkpoints, metrics and resume.

    Every micro-batch is cut into windows of a fixed plan of positions, so the run's
    result does not depend on when slots came: with the same plan, a resumed run takes
    bit for bit the steps of an uninterrupted one. The plan is `plan`, else the one saved
    in `out` (PLAN_FILE) by an earlier start of the same run, else sized from the cost
    model (`plan_positions`) and saved there before the first step."""
    run = _WindowedRun(model, list(examples), list(eval_examples), config, Path(out), pad_token_id)
    run.coserve, run.check = coserve, check
    run.start(resume)
    run.plan = run.window_plan(plan)
    return run.loop(progress, on_step)


class _WindowedRun(_Run):
    coserve: CoServe
    check: Callable[[], None]
    plan: int

    def window_plan(self, given: int | None) -> int:
        path = self.out / PLAN_FILE
        if given is None and path.is_file():
            return int(json.loads(path.read_text(encoding="utf-8"))["window_positions"])
        if given is None:
            longest = max(len(e.input_ids) for e in self.examples)
            given = plan_positions(
                self.coserve.cost, self.coserve.slo_s, self.config.batch_size, longest
            )
        staging = path.with_suffix(".tmp")
        with open(staging, "w", encoding="utf-8") as handle:  # durable before the first step
            json.dump({"window_positions": given}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
        return given

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
                plan=self.plan,
            )
            last = micro == accum - 1  # the optimizer step runs in the last window's slot
            self.coserve.run_step(step, self.check, self._update if last else None)
            total_loss += step.loss.item()
            tokens += int(batch["attention_mask"].sum())
        return total_loss / accum, tokens

    def _update(self) -> None:
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
