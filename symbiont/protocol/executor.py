"""The one interface every way of reaching a base executor implements.

A client sees only `Executor`: a manifest describing the base layers, and `call`, which
runs one base layer forward or backward on flattened tokens. The in-process executor,
and every transport (shared memory, ZeroMQ, ...) implement exactly this, so the same
conformance tests cover all of them. Messages are plain typed values and raw tensors,
so a transport can send them without pickle.

`validate_call` is the one check of a call's fields (layer, direction, shape, dtype, fused
layers, size): the in-process executor, the client (before sending) and the server (for
frames and for shared-memory calls alike) all use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum

import torch

from symbiont.model.layers import LayerSpec
from symbiont.model.moe import ExpertsSpec

PROTOCOL_VERSION = 2  # 2: named, validated message fields (1: positional arrays)

DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_FUSED = 3  # layers that may ride along one forward call (q/k/v: 2, gate/up: 1)


class Op(IntEnum):
    FORWARD = 1  # x [n_tokens, in] -> y [n_tokens, out]
    BACKWARD = 2  # grad_y [n_tokens, out] -> grad_x [n_tokens, in]
    # Experts (`Executor.call_experts`; `layer` is an experts id): hidden [T, H], ids [T, k],
    # weights [T, k] -> y [T, H]; backward also takes grad_y [T, H] and returns
    # grad_hidden [T, H] and grad_weights [T, k] (see symbiont.protocol.experts).
    EXPERTS_FORWARD = 8
    EXPERTS_BACKWARD = 9


EXPERTS_OPS = frozenset({Op.EXPERTS_FORWARD, Op.EXPERTS_BACKWARD})


class ExecutorError(RuntimeError):
    """A base-layer call was refused or failed; the message says what to fix."""


class Code(IntEnum):
    """Why the executor refused a message; sent in ERROR."""

    BAD_MESSAGE = 1  # not a message of this protocol (a field of the wrong type or range)
    BAD_CALL = 2  # unknown layer, wrong shape or dtype
    TOO_LARGE = 3  # over the executor's max_call_bytes
    REFUSED = 4  # wrong token, protocol or checkpoint; too many clients
    NO_SESSION = 5  # no handshake on this connection (or it expired): say HELLO again
    INTERNAL = 6  # the executor failed running a valid call
    BUSY = 7  # a call is already in flight on this connection: wait for its answer


class ProtocolError(ValueError):
    """A message or call that this protocol refuses: `code` goes back in ERROR, the text
    names the field and what it should be. `call_id` is the sender's id when known."""

    legacy = False  # a protocol-1 header: answer it the way protocol 1 reads

    def __init__(self, code: Code, message: str, call_id: int = 0):
        super().__init__(message)
        self.code = code
        self.call_id = call_id


class ExecutorUnavailable(ExecutorError):
    """The base executor could not be reached, or stopped answering, within the timeouts."""


@dataclass(frozen=True)
class Manifest:
    """What an executor serves: which checkpoint, in which dtype, which layers."""

    fingerprint: str
    dtype: torch.dtype
    layers: tuple[LayerSpec, ...]
    protocol: int = PROTOCOL_VERSION
    experts: tuple[ExpertsSpec, ...] = ()  # MoE expert stacks (symbiont.model.moe)

    def layer_ids(self) -> dict[str, int]:
        return {spec.name: spec.id for spec in self.layers}

    def to_dict(self) -> dict:
        data = {
            "fingerprint": self.fingerprint,
            "dtype": str(self.dtype).removeprefix("torch."),
            "layers": [spec.to_dict() for spec in self.layers],
            "protocol": self.protocol,
        }
        if self.experts:  # absent for dense models: what older peers read is unchanged
            data["experts"] = [spec.to_dict() for spec in self.experts]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        return cls(
            fingerprint=data["fingerprint"],
            dtype=getattr(torch, data["dtype"]),
            layers=tuple(LayerSpec.from_dict(layer) for layer in data["layers"]),
            protocol=data["protocol"],
            experts=tuple(ExpertsSpec.from_dict(e) for e in data.get("experts", ())),
        )


class Executor(ABC):
    """Runs frozen base layers for clients. Holds no per-client or per-call state."""

    def __deepcopy__(self, memo):
        # The base is shared, not owned: a copied client (copy.deepcopy, PEFT's
        # layer_replication) calls the same executor; copying it copied the whole base
        # in process, and failed on a connection's lock over serve-base.
        return self

    @property
    @abstractmethod
    def manifest(self) -> Manifest: ...

    @abstractmethod
    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Run `layer` in direction `op` on flattened tokens; see `Op` for shapes."""

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.call(Op.FORWARD, layer, x)

    # True when `forward_fused` computes its layers in one pass (one matmul), so a client
    # should group the calls that feed one input to several layers; the default runs
    # them one by one (a transport may still fuse on its own, as RemoteExecutor does).
    fuses_calls: bool = False

    def forward_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """FORWARD of each of `layers` (at most 1 + MAX_FUSED, equal input widths) on the
        same x [n_tokens, in] -> [[n_tokens, out_l] per layer], in `layers` order."""
        return [self.call(Op.FORWARD, layer, x) for layer in layers]

    def backward(self, layer: int, grad_y: torch.Tensor) -> torch.Tensor:
        return self.call(Op.BACKWARD, layer, grad_y)

    def call_experts(
        self,
        op: Op,
        experts: int,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        grad_y: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run MoE experts stack `experts` on hidden [T, H] routed by ids [T, k] (int64)
        with weights [T, k]: EXPERTS_FORWARD returns (y [T, H],); EXPERTS_BACKWARD, given
        grad_y [T, H], returns (grad_hidden [T, H], grad_weights [T, k]), recomputing the
        forward (nothing is kept between calls)."""
        raise ExecutorError(
            f"{type(self).__name__} does not run mixture-of-experts layers; use a "
            "BaseExecutor or connect() to a serve-base of this symbiont version"
        )

    def close(self) -> None:  # noqa: B027 - transports override; in-process has nothing to free
        """Release connections and buffers; the executor itself keeps serving others."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_call(manifest: Manifest, op: Op, layer: int, x: torch.Tensor) -> None:
    """Refuse a malformed tensor call with a message that says what to fix."""
    try:
        validate_call(manifest, op, layer, tuple(x.shape), x.dtype)
    except ProtocolError as err:
        raise ExecutorError(str(err)) from None


def validate_fused(manifest: Manifest, layers: tuple[int, ...], x: torch.Tensor) -> None:
    """Refuse a malformed fused forward (`Executor.forward_fused`) naming the fix."""
    if not layers:
        raise ExecutorError("a fused call needs at least one layer")
    try:
        validate_call(manifest, Op.FORWARD, layers[0], tuple(x.shape), x.dtype, layers[1:])
    except ProtocolError as err:
        raise ExecutorError(str(err)) from None


def validate_call(
    manifest: Manifest,
    op: Op,
    layer: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fused: tuple[int, ...] = (),
    max_bytes: int | None = None,
) -> None:
    """Check one call: `layer` in `op`'s direction on x of `shape` [n_tokens, width] (width
    None: implied, as in shared memory) in `dtype`, plus the `fused` layers fed the same x (forward only), input and outputs each
    within `max_bytes`. Raises ProtocolError (BAD_CALL or TOO_LARGE) naming the fix."""
    layers = manifest.layers
    if op in EXPERTS_OPS:
        raise ProtocolError(Code.BAD_CALL, f"{op.name} is not a base-layer op: use call_experts")
    if type(layer) is not int or not 0 <= layer < len(layers):
        raise ProtocolError(
            Code.BAD_CALL,
            f"unknown layer id {layer!r}: this executor serves layers 0..{len(layers) - 1}",
        )
    spec = layers[layer]
    width, out = (
        (spec.in_features, spec.out_features)
        if op is Op.FORWARD
        else (spec.out_features, spec.in_features)
    )
    if len(shape) != 2 or shape[1] not in (width, None):
        raise ProtocolError(
            Code.BAD_CALL,
            f"layer {layer} ({spec.name}) {op.name.lower()} expects [n_tokens, {width}], "
            f"got {list(shape)}",
        )
    if dtype != manifest.dtype:
        raise ProtocolError(
            Code.BAD_CALL,
            f"layer {layer} ({spec.name}) runs in {manifest.dtype}, got {dtype}; "
            f"load the client with dtype={manifest.dtype}",
        )
    if fused:
        out += _fused_width(manifest, op, layer, fused)
    if max_bytes is not None and shape[0] * max(width, out) * dtype.itemsize > max_bytes:
        raise ProtocolError(
            Code.TOO_LARGE,
            f"a call of {shape[0]} tokens on layer {layer} ({spec.name}) exceeds this "
            f"executor's max_call_bytes ({max_bytes}); split it into smaller calls",
        )


def _fused_width(manifest: Manifest, op: Op, layer: int, fused: tuple[int, ...]) -> int:
    """Summed output width of the layers fused into a forward call of `layer`."""
    if op is not Op.FORWARD or len(fused) > MAX_FUSED:
        raise ProtocolError(
            Code.BAD_CALL, f"only forward calls fuse, at most {MAX_FUSED} more layers"
        )
    layers, width = manifest.layers, 0
    for other in fused:
        if not 0 <= other < len(layers) or layers[other].in_features != layers[layer].in_features:
            raise ProtocolError(
                Code.BAD_CALL,
                f"layer {other} cannot be fused with layer {layer}: its input width differs "
                "or it does not exist",
            )
        width += layers[other].out_features
    return width
