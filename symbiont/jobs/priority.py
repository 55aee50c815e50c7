"""Priority classes on one base executor: inference calls before fine-tuning calls.

The serving engine and the fine-tuning worker share the engine's executor object, called
from two threads. Both kinds of call are wrapped:

- `InferenceExecutor` counts the inference calls in flight;
- `TrainingExecutor` waits, before each fine-tuning call, until no inference call is in
  flight, for at most `max_wait_s`, so a busy server slows fine-tuning down but never
  starves it; it also runs a check first (the worker's cancel/stop flag), so a cancel
  takes effect within one base-layer call.

Calls on a shared executor are serialized (`PriorityGate.calls`, one lock): an executor
may keep state between calls (a masked one remembers the last input and its mask, a
remote one its connection), so two threads must not interleave inside it; and one call
at a time is what makes the priority real (an inference call waits for at most the one
fine-tuning call already running, never for a stream of them). A worker that reaches a
`serve-base` over its own connection needs none of this: the gate is then `shared=False`.

That is the cheap part of FlexLLM's co-serving: inference goes first whenever both wait,
at the grain of one base-layer call. With `--slo-tpot-ms` the token-level scheduler of
symbiont/jobs/coserve.py decides when fine-tuning runs; the gate still covers what runs
outside its slots (evaluation, checkpoints). The counter is read without the lock on the
fast path, so a fine-tuning call pays no wait while the server is idle.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from symbiont.client.virt import VirtLayer
from symbiont.protocol.executor import Executor, Manifest, Op


class PriorityGate:
    def __init__(self, max_wait_s: float = 0.05, shared: bool = True):
        self.max_wait_s = max_wait_s
        self.waited_s = 0.0  # total time fine-tuning calls spent giving way
        self._in_flight = 0
        self._idle = threading.Condition()
        self.calls = threading.Lock() if shared else contextlib.nullcontext()

    def share(self, shared: bool) -> None:
        """Whether both sides call one executor object (then calls are serialized)."""
        self.calls = threading.Lock() if shared else contextlib.nullcontext()

    def inference_started(self) -> None:
        with self._idle:
            self._in_flight += 1

    def inference_done(self) -> None:
        with self._idle:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def wait_for_inference(self) -> None:
        """Block a fine-tuning call while inference calls run (at most max_wait_s)."""
        if self._in_flight == 0:  # unlocked read: a stale value costs one late yield
            return
        started = time.perf_counter()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=self.max_wait_s)
        self.waited_s += time.perf_counter() - started


class _Wrapped(Executor):
    def __init__(self, inner: Executor):
        self.inner = inner

    @property
    def manifest(self) -> Manifest:
        return self.inner.manifest

    @property
    def fuses_calls(self) -> bool:  # q/k/v and gate/up stay one call through the gate
        return self.inner.fuses_calls

    def close(self) -> None:
        """The inner executor belongs to whoever opened it."""


class InferenceExecutor(_Wrapped):
    def __init__(self, inner: Executor, gate: PriorityGate):
        super().__init__(inner)
        self.gate = gate

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.gate.inference_started()
        try:
            with self.gate.calls:
                return self.inner.call(op, layer, x)
        finally:
            self.gate.inference_done()

    def forward_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        self.gate.inference_started()
        try:
            with self.gate.calls:
                return self.inner.forward_fused(layers, x)
        finally:
            self.gate.inference_done()


class TrainingExecutor(_Wrapped):
    def __init__(self, inner: Executor, gate: PriorityGate, check: Callable[[], None]):
        super().__init__(inner)
        self.gate, self.check = gate, check

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.check()
        self.gate.wait_for_inference()
        with self.gate.calls:
            return self.inner.call(op, layer, x)

    def forward_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        self.check()
        self.gate.wait_for_inference()
        with self.gate.calls:
            return self.inner.forward_fused(layers, x)


def model_executor(model: torch.nn.Module) -> Executor:
    """The executor the base layers of `model` (a client model) call."""
    for module in model.modules():
        if isinstance(module, VirtLayer):
            executor = module.executor
            return executor.inner if isinstance(executor, InferenceExecutor) else executor
    raise ValueError("the model has no base layers on an executor (not a symbiont client)")


def give_inference_priority(model: torch.nn.Module, gate: PriorityGate) -> None:
    """Route every base-layer call of `model` (the serving engine's) through the gate, one
    wrapper per executor: fused calls are learned per executor object."""
    wrappers: dict[int, InferenceExecutor] = {}
    for module in model.modules():
        if isinstance(module, VirtLayer) and not isinstance(module.executor, InferenceExecutor):
            inner = module.executor
            if id(inner) not in wrappers:
                wrappers[id(inner)] = InferenceExecutor(inner, gate)
            module.executor = wrappers[id(inner)]
