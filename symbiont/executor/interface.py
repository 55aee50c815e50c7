"""The one interface every way of reaching a base executor implements.

A client sees only `Executor`: a manifest describing the base layers, and `call`, which
runs one base layer forward or backward on flattened tokens. The in-process executor,
and every transport (shared memory, ZeroMQ, ...) implement exactly this, so the same
conformance tests cover all of them. Messages are plain typed values and raw tensors,
so a transport can send them without pickle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum

import torch

from symbiont.layers import LayerSpec

PROTOCOL_VERSION = 1


class Op(IntEnum):
    FORWARD = 1  # x [n_tokens, in] -> y [n_tokens, out]
    BACKWARD = 2  # grad_y [n_tokens, out] -> grad_x [n_tokens, in]


class ExecutorError(RuntimeError):
    """A base-layer call was refused or failed; the message says what to fix."""


class ExecutorUnavailable(ExecutorError):
    """The base executor could not be reached, or stopped answering, within the timeouts."""


@dataclass(frozen=True)
class Manifest:
    """What an executor serves: which checkpoint, in which dtype, which layers."""

    fingerprint: str
    dtype: torch.dtype
    layers: tuple[LayerSpec, ...]
    protocol: int = PROTOCOL_VERSION

    def layer_ids(self) -> dict[str, int]:
        return {spec.name: spec.id for spec in self.layers}

    def to_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "dtype": str(self.dtype).removeprefix("torch."),
            "layers": [spec.to_dict() for spec in self.layers],
            "protocol": self.protocol,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        return cls(
            fingerprint=data["fingerprint"],
            dtype=getattr(torch, data["dtype"]),
            layers=tuple(LayerSpec.from_dict(layer) for layer in data["layers"]),
            protocol=data["protocol"],
        )


class Executor(ABC):
    """Runs frozen base layers for clients. Holds no per-client or per-call state."""

    @property
    @abstractmethod
    def manifest(self) -> Manifest: ...

    @abstractmethod
    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Run `layer` in direction `op` on flattened tokens; see `Op` for shapes."""

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.call(Op.FORWARD, layer, x)

    def backward(self, layer: int, grad_y: torch.Tensor) -> torch.Tensor:
        return self.call(Op.BACKWARD, layer, grad_y)

    def close(self) -> None:  # noqa: B027 - transports override; in-process has nothing to free
        """Release connections and buffers; the executor itself keeps serving others."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_call(manifest: Manifest, op: Op, layer: int, x: torch.Tensor) -> None:
    """Refuse a malformed call with a message that says what to fix."""
    if not isinstance(layer, int) or not 0 <= layer < len(manifest.layers):
        raise ExecutorError(
            f"unknown layer id {layer!r}: this executor serves layers 0..{len(manifest.layers) - 1}"
        )
    spec = manifest.layers[layer]
    width = spec.in_features if op is Op.FORWARD else spec.out_features
    if x.dim() != 2 or x.shape[1] != width:
        raise ExecutorError(
            f"layer {layer} ({spec.name}) {op.name.lower()} expects [n_tokens, {width}], "
            f"got {list(x.shape)}"
        )
    if x.dtype != manifest.dtype:
        raise ExecutorError(
            f"layer {layer} ({spec.name}) runs in {manifest.dtype}, got {x.dtype}; "
            f"load the client with dtype={manifest.dtype}"
        )
