"""Fusing forward calls that take the very same input (q/k/v, gate/up) into one round trip.

A decode step makes one executor call per frozen linear layer, and the round trip, not
the matmul, dominates it. Attention projections and gated MLPs feed one tensor to
several layers in a row. The client notices this (the same tensor, unmodified, passed to
consecutive calls), and from then on sends the first layer's call together with the
layers that followed it; their outputs wait here until the model asks for them. No
change to the model code: a call whose input is not that very tensor (checked by storage
address, shape, strides and in-place version) is sent as usual. A remote executor's
transport does this per connection (`RemoteExecutor`); VirtLayers do it for an
in-process executor whose `forward_fused` is one matmul (`fusion_for`), per thread.

Tensors made under `torch.inference_mode` keep no version counter, so an in-place edit
between two calls could not be seen: calls on them are never fused (each is sent alone).
"""

from __future__ import annotations

import threading
import weakref

import torch

from symbiont.protocol.shm import MAX_FUSED


class Seen:
    """A tensor as it was when a call took it: holding it keeps its storage alive, so an
    equal address later cannot belong to a new tensor; `version` catches in-place edits."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.version = tensor._version

    def matches(self, x: torch.Tensor) -> bool:
        """Is `x` this very tensor (any view with the same layout), unmodified since?"""
        seen = self.tensor
        return (
            x.data_ptr() == seen.data_ptr()
            and x._version == self.version
            and x.shape == seen.shape
            and x.stride() == seen.stride()
            and x.dtype == seen.dtype
            and x.device == seen.device
        )


class Fusion:
    """Learns which layer follows which on one input, plans fused calls, keeps their outputs."""

    def __init__(self) -> None:
        self.follows: dict[int, int] = {}  # layer -> the layer called next on the same input
        self.last: tuple[int, Seen] | None = None
        self.ready: dict[int, torch.Tensor] = {}  # layer -> its output for `ready_x`
        self.ready_x: Seen | None = None
        self.planner: int | None = None  # the layer whose call computed `ready`

    def take(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        """The output of `layer` on `x` if a fused call already computed it."""
        if self.ready and x.is_inference():
            self.ready.clear()
            self.ready_x = None
        if self.ready:
            if layer in self.ready and self.ready_x.matches(x):
                self.last = (layer, self.ready_x)
                return self.ready.pop(layer)
            # Computed for nothing: the model no longer feeds one input to these layers
            # (e.g. an adapter now scales one layer's input). Learn the order afresh.
            self.follows.pop(self.planner, None)
            self.ready.clear()
            self.ready_x = None
        return None

    def plan(self, layer: int, x: torch.Tensor) -> tuple[int, ...]:
        """Layers to compute along with `layer` on `x` (learning from the previous call)."""
        if x.is_inference():  # no version counter: an in-place edit would go unseen
            self.last = None
            return ()
        if self.last is not None and self.last[0] != layer and self.last[1].matches(x):
            self.follows[self.last[0]] = layer
        self.last = (layer, Seen(x))
        group: list[int] = []
        current = layer
        while current in self.follows and len(group) < MAX_FUSED:
            current = self.follows[current]
            if current == layer or current in group:
                break
            group.append(current)
        return tuple(group)

    def keep(self, x: torch.Tensor, layers: tuple[int, ...], outputs: list[torch.Tensor]) -> None:
        self.ready = dict(zip(layers, outputs, strict=True))
        self.ready_x = self.last[1] if self.last and self.last[1].tensor is x else Seen(x)
        self.planner = self.last[0] if self.last else None

    def forget(self) -> None:
        """Drop held tensors (on close or reconnect)."""
        self.last = None
        self.ready.clear()
        self.ready_x = None


class LocalFusion(threading.local):
    """A `Fusion` per thread (`state`): a serving engine and a fine-tuning job may call
    one in-process executor from two threads at once, each with its own order of calls.
    (Read `state` once per call: each attribute of a thread-local costs a lookup.)"""

    def __init__(self) -> None:
        self.state = Fusion()

    def __reduce__(self):
        # A copied model (deepcopy, pickle) starts with fresh state: what is held here
        # is the original's tensors (its layers still share the executor).
        return (LocalFusion, ())


_IN_PROCESS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IN_PROCESS_LOCK = threading.Lock()


def fusion_for(executor) -> LocalFusion:
    """The fusion state of the VirtLayers calling `executor` (one per executor and
    thread: layer ids and held outputs belong to one executor)."""
    with _IN_PROCESS_LOCK:
        fusion = _IN_PROCESS.get(executor)
        if fusion is None:
            fusion = _IN_PROCESS[executor] = LocalFusion()
        return fusion
