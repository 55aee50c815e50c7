"""Mixture-of-experts calls: their one validation and the byte layout of their tensors.

An experts call (`Op.EXPERTS_FORWARD` / `Op.EXPERTS_BACKWARD`, see `Executor.call_experts`)
carries tensors of different dtypes, packed back to back in one buffer (a CALL's tensor
frame, or a shared-memory input area), each part starting on an 8-byte boundary so it can
be viewed in place:

    request   ids int64 [T, k] | hidden [T, H] | grad_y [T, H] (backward) | weights [T, k]
    reply     y [T, H]                               (forward)
              grad_hidden [T, H] | grad_weights [T, k]  (backward)

`hidden`, `grad_y` and the gradients are in the executor's dtype; the routing weights in
their own (float32, or the executor's dtype): families differ, and the experts compute
with them as the family made them. `validate_experts` checks the call's fields against the
manifest before any byte is read; `validate_experts_values` checks the tensors themselves
(expert ids in range, everything finite), since an id out of range would index another
expert's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from symbiont.model.moe import ExpertsSpec
from symbiont.protocol.executor import (
    DTYPE_NAMES,
    Code,
    ExecutorError,
    Manifest,
    Op,
    ProtocolError,
)

ALIGN = 8
IDS_DTYPE = torch.int64  # what torch.topk returns


@dataclass(frozen=True)
class Part:
    name: str
    offset: int  # bytes from the start of the buffer
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Where each tensor of an experts request or reply lies in one byte buffer."""

    parts: tuple[Part, ...]
    nbytes: int

    def views(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> tensor viewing `raw` (uint8, at least `nbytes`), no copy."""
        return {
            p.name: raw[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
            for p in self.parts
        }

    def write(self, raw: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        for name, view in self.views(raw).items():
            view.copy_(tensors[name])

    def pack(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One uint8 buffer [nbytes] holding `tensors` (padding zeroed)."""
        raw = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.write(raw, tensors)
        return raw


def _layout(entries: list[tuple[str, tuple[int, int], torch.dtype]]) -> Layout:
    parts, offset = [], 0
    for name, shape, dtype in entries:
        parts.append(Part(name, offset, shape, dtype))
        offset += -(-shape[0] * shape[1] * dtype.itemsize // ALIGN) * ALIGN
    return Layout(tuple(parts), offset)


def request_layout(
    op: Op, rows: int, top_k: int, width: int, dtype: torch.dtype, weights_dtype: torch.dtype
) -> Layout:
    entries = [("ids", (rows, top_k), IDS_DTYPE), ("hidden", (rows, width), dtype)]
    if op is Op.EXPERTS_BACKWARD:
        entries.append(("grad_y", (rows, width), dtype))
    entries.append(("weights", (rows, top_k), weights_dtype))
    return _layout(entries)


def reply_layout(
    op: Op, rows: int, top_k: int, width: int, dtype: torch.dtype, weights_dtype: torch.dtype
) -> Layout:
    if op is Op.EXPERTS_FORWARD:
        return _layout([("y", (rows, width), dtype)])
    return _layout(
        [("grad_hidden", (rows, width), dtype), ("grad_weights", (rows, top_k), weights_dtype)]
    )


REPLY_NAMES = {Op.EXPERTS_FORWARD: ("y",), Op.EXPERTS_BACKWARD: ("grad_hidden", "grad_weights")}


def weights_dtypes(manifest: Manifest) -> tuple[torch.dtype, ...]:
    """Routing-weight dtypes an executor accepts: float32 (Mixtral routes in float32
    whatever the model's dtype) and its own."""
    return tuple(dict.fromkeys((torch.float32, manifest.dtype)))


def validate_experts(
    manifest: Manifest,
    op: Op,
    experts: int,
    rows: int,
    width: int | None,
    top_k: int,
    dtype: torch.dtype,
    weights_dtype: torch.dtype,
    max_bytes: int | None = None,
) -> ExpertsSpec:
    """Check an experts call's fields (width None: implied, as in shared memory): which
    stack, hidden [rows, H] in the executor's dtype, k choices per token, the routing
    weights' dtype, request and reply each within `max_bytes`. Raises ProtocolError."""
    stacks = manifest.experts
    if op not in REPLY_NAMES:
        raise ProtocolError(Code.BAD_CALL, f"{op.name} is not an experts op")
    if type(experts) is not int or not 0 <= experts < len(stacks):
        served = f"0..{len(stacks) - 1}" if stacks else "none (a dense model)"
        raise ProtocolError(
            Code.BAD_CALL, f"unknown experts id {experts!r}: this executor serves experts {served}"
        )
    spec = stacks[experts]
    if rows < 0 or width not in (spec.hidden, None):
        raise ProtocolError(
            Code.BAD_CALL,
            f"experts {experts} ({spec.name}) expects hidden states [n_tokens, {spec.hidden}], "
            f"got [{rows}, {width}]",
        )
    if type(top_k) is not int or not 1 <= top_k <= spec.num_experts:
        raise ProtocolError(
            Code.BAD_CALL,
            f"experts {experts} ({spec.name}) has {spec.num_experts} experts: each token picks "
            f"1..{spec.num_experts} of them, got top_k={top_k!r}",
        )
    if dtype != manifest.dtype:
        raise ProtocolError(
            Code.BAD_CALL,
            f"experts {experts} ({spec.name}) run in {manifest.dtype}, got hidden states in "
            f"{dtype}; load the client with dtype={manifest.dtype}",
        )
    allowed = weights_dtypes(manifest)
    if weights_dtype not in allowed:
        raise ProtocolError(
            Code.BAD_CALL,
            f"routing weights in {weights_dtype}: send them in one of "
            f"{', '.join(DTYPE_NAMES[d] for d in allowed)}",
        )
    if max_bytes is not None:
        args = (op, rows, top_k, spec.hidden, dtype, weights_dtype)
        if max(request_layout(*args).nbytes, reply_layout(*args).nbytes) > max_bytes:
            raise ProtocolError(
                Code.TOO_LARGE,
                f"an experts call of {rows} tokens on {spec.name} exceeds this executor's "
                f"max_call_bytes ({max_bytes}); split it into smaller calls",
            )
    return spec


def validate_experts_values(
    spec: ExpertsSpec, ids: torch.Tensor, weights: torch.Tensor, *activations: torch.Tensor
) -> None:
    """Expert ids within 0..num_experts-1, routing weights and activations finite."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_experts):
        raise ProtocolError(
            Code.BAD_CALL,
            f"expert ids must lie in 0..{spec.num_experts - 1} for {spec.name}, got "
            f"{int(ids.min())}..{int(ids.max())}",
        )
    for name, tensor in (("routing weights", weights), *(("activations", a) for a in activations)):
        if not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(
                Code.BAD_CALL, f"{name} sent to {spec.name} hold NaN or inf: fix the client"
            )


def check_experts_call(
    manifest: Manifest,
    op: Op,
    experts: int,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    grad_y: torch.Tensor | None,
) -> ExpertsSpec:
    """Refuse a malformed experts call of tensors with a message that says what to fix
    (the in-process executor and a client before sending)."""
    try:
        if hidden.dim() != 2 or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
            raise ProtocolError(
                Code.BAD_CALL,
                f"experts calls take hidden [T, H] and ids [T, k]: got {list(hidden.shape)} "
                f"and {list(ids.shape)}",
            )
        if weights.shape != ids.shape or ids.dtype != IDS_DTYPE:
            raise ProtocolError(
                Code.BAD_CALL,
                f"routing weights {list(weights.shape)} must match ids {list(ids.shape)}, and "
                f"ids must be {IDS_DTYPE} (got {ids.dtype})",
            )
        if (grad_y is not None) != (op is Op.EXPERTS_BACKWARD) or (
            grad_y is not None and (grad_y.shape != hidden.shape or grad_y.dtype != hidden.dtype)
        ):
            raise ProtocolError(
                Code.BAD_CALL, "EXPERTS_BACKWARD (and only it) takes grad_y shaped like hidden"
            )
        rows, width = hidden.shape
        spec = validate_experts(
            manifest, op, experts, rows, width, ids.shape[1], hidden.dtype, weights.dtype
        )
        extra = () if grad_y is None else (grad_y,)
        validate_experts_values(spec, ids, weights, hidden, *extra)
    except ProtocolError as err:
        raise ExecutorError(str(err)) from None
    return spec
