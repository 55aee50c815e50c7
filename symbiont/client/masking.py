"""Activations the executor cannot read: additive masks that cancel exactly by linearity.

A base layer is linear, so a client may send `x + m` instead of `x` and remove `m`'s
effect from the answer (Symbiosis 3.8). The paper draws `m` from a pool of two noises
per layer, which an executor can tell apart and subtract. Two modes here, forward and
backward alike (backward sends `grad_y + m` and removes `m W`):

- `pool` (one executor): K noises per input width, and every call adds a fresh secret
  combination of them, one per token: `m = C N` with `C [n_tokens, K]` drawn per call.
  The client computes each noise's effect `N Wᵀ` itself, layer by layer from the public
  checkpoint, never asking the executor (a lying executor cannot poison the mask). Cheap,
  but the masks span only K directions: an executor that records many calls finds them
  by principal components and projects them away (docs/privacy.md measures it).
- `shares` (two executors run by parties that do not collude): per call a fresh
  full-rank `r`; `x + r` goes to one, `-r` to the other, and the replies add up to
  `x Wᵀ + 2b` (the bias is subtracted once, read from the checkpoint).

Noise is Gaussian with `noise_scale` (64; growing as √width above 1024) times the root
mean square of the call's own tensor, so each received tensor is at most
`1 / noise_scale` correlated with the true one. Calls that take the very same input (q/k/v projections of one hidden state) get the
very same mask: averaging them gains an executor nothing, and the transport can still
fuse them into one round trip.

Both wrappers are ordinary `Executor`s, so VirtLayers and every transport are unchanged.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from symbiont.client.remote import RemoteExecutor
from symbiont.model.checkpoint import Checkpoint
from symbiont.model.layers import base_forward, base_input_grad
from symbiont.model.skeleton import build_skeleton, checkpoint_key
from symbiont.protocol.executor import Executor, ExecutorError, Manifest, Op, check_call

# Masks are `noise_scale` times larger than the activations, so the answer keeps
# log2(noise_scale) bits fewer of precision: fine in float32, ruinous in 16-bit types.
MASKABLE_DTYPES = (torch.float32, torch.float64)
REFERENCE_WIDTH = 1024  # noise_scale applies up to this width, and grows as √width above


class MaskMode(StrEnum):
    POOL = "pool"  # one executor, K pooled noises per width, fresh combination per call
    SHARES = "shares"  # two non-colluding executors, fresh full-rank noise per call


MODES_HELP = "'pool' (or True), 'shares', or None/False for no masking"


@dataclass(frozen=True)
class MaskConfig:
    """How a client masks what it sends to its executor(s)."""

    mode: MaskMode = MaskMode.POOL
    pool_size: int = field(default=16, metadata={"help": "K: noises per input width (pool)"})
    noise_scale: float = field(
        default=64.0,
        metadata={"help": "noise rms / activation rms of each call, at widths up to 1024"},
    )
    seed: int | None = None  # None: secret, from the OS; an int only for reproducible tests

    def __post_init__(self) -> None:
        if self.mode not in tuple(MaskMode):
            raise ValueError(f"unknown mask_activations mode {self.mode!r}; use {MODES_HELP}")
        object.__setattr__(self, "mode", MaskMode(self.mode))
        if not isinstance(self.pool_size, int) or self.pool_size < 1:
            raise ValueError(f"pool_size must be an int >= 1, got {self.pool_size!r}")
        if not self.noise_scale > 0:
            raise ValueError(f"noise_scale must be > 0, got {self.noise_scale!r}")


def mask_config(value) -> MaskConfig | None:
    """`mask_activations` as given by a user (None, False, True, a mode name or a
    MaskConfig) -> MaskConfig, or None for no masking."""
    if value is None or value is False:
        return None
    if value is True:
        return MaskConfig(MaskMode.POOL)
    if isinstance(value, MaskConfig):
        return value
    if isinstance(value, str) and value in tuple(MaskMode):
        return MaskConfig(MaskMode(value))
    raise ValueError(f"unknown mask_activations {value!r}; use {MODES_HELP}")


def mask_executors(
    path: str | os.PathLike,
    executors: Executor | Sequence[Executor],
    mask_activations=None,
    *,
    device: str | torch.device = "cpu",
) -> Executor:
    """The executor a client should call: `executors` itself when unmasked, else a
    wrapper that masks every call. `path` is the checkpoint the executors serve (pool
    mode reads its linear weights one layer at a time to precompute the noise effects;
    shares mode reads only the biases). Refuses an unknown mode, `shares` without two
    executors, two executors without `shares`, and two executors of different bases."""
    config = mask_config(mask_activations)
    if config is None and not isinstance(executors, (tuple, list)):
        return executors  # unmasked: whatever the caller passed, as before
    pair = _as_tuple(executors)
    if config is None or config.mode is MaskMode.POOL:
        if len(pair) != 1:
            raise ValueError(
                f"{len(pair)} executors were given with mask_activations={mask_activations!r}; "
                "several executors are only used by mask_activations='shares' (two parties "
                "that do not collude). Pass one executor, or mask_activations='shares'"
            )
        if config is None:
            return pair[0]
    elif len(pair) != 2:
        raise ValueError(
            f"mask_activations='shares' needs two executors run by parties that do not "
            f"collude, got {len(pair)}: pass load_client(path, (executor_a, executor_b), "
            "mask_activations='shares'), or on the command line --executor URL_A "
            "--executor URL_B"
        )
    if config.mode is MaskMode.SHARES:
        _check_two_parties(pair)
    manifest = _common_manifest(pair)
    if getattr(manifest, "experts", ()):
        raise ValueError(
            "masked activations do not cover mixture-of-experts layers yet: an expert call "
            "carries routing ids and weights the masks cannot hide, and its output is not "
            "linear in them; load this model without mask_activations"
        )
    if manifest.dtype not in MASKABLE_DTYPES:
        raise ValueError(
            f"masked activations need a float32 base, this executor runs {manifest.dtype}: "
            f"masks are {config.noise_scale:g}x the activations, which would cost about "
            f"{config.noise_scale * torch.finfo(manifest.dtype).eps:.0%} relative error in "
            "it; start serve-base with --dtype float32"
        )
    checkpoint = _same_checkpoint(path, manifest)
    device = torch.device(device)
    if config.mode is MaskMode.POOL:
        return PoolMaskedExecutor(
            pair[0], config, _pool_tables(checkpoint, manifest, config, device)
        )
    return SharesExecutor(pair, config, _biases(checkpoint, manifest, device))


def _check_two_parties(pair: tuple[Executor, ...]) -> None:
    """Shares hide x only from parties that each see one share: the same executor twice
    (one object, one URL, or two endpoints of one serve-base) sees both, so x + r - r."""
    a, b = pair
    same = a is b
    if getattr(a, "url", None) is not None and getattr(a, "url", None) == getattr(b, "url", None):
        same = True
    instance = getattr(a, "instance", None)
    if instance is not None and instance == getattr(b, "instance", None):
        same = True
    if same:
        raise ValueError(
            "mask_activations='shares' was given the same executor twice (one serve-base "
            "process, reached through both URLs): it would see both shares and so the "
            "activations; give two serve-base run by parties that do not collude"
        )


def _as_tuple(executors) -> tuple[Executor, ...]:
    if isinstance(executors, Executor):
        return (executors,)
    if isinstance(executors, (tuple, list)) and all(isinstance(e, Executor) for e in executors):
        return tuple(executors)
    raise TypeError(
        f"expected an Executor or a pair of them, got {type(executors).__name__}; "
        "open one with symbiont.connect(url) or symbiont.BaseExecutor.from_pretrained(path)"
    )


def _common_manifest(executors: tuple[Executor, ...]) -> Manifest:
    first = executors[0].manifest
    for other in executors[1:]:
        theirs = other.manifest
        for what, mine, their in (
            ("checkpoint fingerprint", first.fingerprint, theirs.fingerprint),
            ("dtype", first.dtype, theirs.dtype),
            ("protocol", first.protocol, theirs.protocol),
            ("layers", first.layers, theirs.layers),
        ):
            if mine != their:
                shown = (mine, their) if what != "layers" else ("...", "...")
                raise ValueError(
                    f"the two executors serve different bases ({what}: {shown[0]} vs "
                    f"{shown[1]}); in shares mode both must serve the same checkpoint in "
                    "the same dtype: start both serve-base with the same --model and --dtype"
                )
    return first


def _same_checkpoint(path, manifest: Manifest) -> Checkpoint:
    checkpoint = Checkpoint.open(path)
    if checkpoint.fingerprint != manifest.fingerprint:
        raise ExecutorError(
            f"checkpoint {checkpoint.path} (fingerprint {checkpoint.fingerprint}) is not the "
            f"base the executor serves (fingerprint {manifest.fingerprint}); masking reads "
            "the same public checkpoint the executor was started with"
        )
    return checkpoint


def _read_layers(checkpoint: Checkpoint, manifest: Manifest, *, weights: bool):
    """(spec, weight, bias) per base layer, one at a time, in float64 but rounded to the
    executor's dtype first (so they are the very values it computes with). weight is
    None unless `weights`; bias None unless the layer has one."""
    skeleton = build_skeleton(checkpoint.config, manifest.dtype)

    def read(name: str) -> torch.Tensor:
        key = checkpoint_key(skeleton, checkpoint, name)
        return checkpoint.read(key, dtype=manifest.dtype).double()

    for spec in manifest.layers:
        weight = read(f"{spec.name}.weight") if weights else None
        bias = read(f"{spec.name}.bias") if spec.has_bias else None
        yield spec, weight, bias


# -- pool --------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolTables:
    """The secret noise pools and their precomputed effects, on the client's device."""

    noises: dict[int, torch.Tensor]  # width -> N [K, width], orthonormal rows when K <= width
    forward: list[torch.Tensor]  # per layer: N_in Wᵀ [K, out]
    backward: list[torch.Tensor]  # per layer: N_out W [K, in]


def _pool_tables(
    checkpoint: Checkpoint, manifest: Manifest, config: MaskConfig, device
) -> PoolTables:
    generator = _generator(config.seed, torch.device("cpu"))
    widths = sorted({w for s in manifest.layers for w in (s.in_features, s.out_features)})
    noises = {w: _noise_basis(config.pool_size, w, generator) for w in widths}
    forward, backward = [], []
    for spec, weight, _ in _read_layers(checkpoint, manifest, weights=True):
        # The noises' effects, computed exactly as the executor computes a call (no bias:
        # the executor adds it once, to x + m).
        forward.append(base_forward(spec.kind, weight, None, noises[spec.in_features]))
        backward.append(base_input_grad(spec.kind, weight, noises[spec.out_features]))
        del weight  # one layer's weight at a time
    cast = {"dtype": manifest.dtype, "device": device}
    return PoolTables(
        {w: n.to(**cast) for w, n in noises.items()},
        [e.to(**cast) for e in forward],
        [e.to(**cast) for e in backward],
    )


def _noise_basis(k: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """K noise directions of `width` [K, width]: orthonormal rows when K <= width (a clean
    K-dimensional subspace), unit-norm random rows otherwise. float64."""
    noise = torch.randn(k, width, generator=generator, dtype=torch.float64)
    if k <= width:
        return torch.linalg.qr(noise.T).Q.T.contiguous()
    return noise / noise.norm(dim=1, keepdim=True)


class PoolMaskedExecutor(Executor):
    """One executor; every call sends `x + C N` and removes `C (N Wᵀ)` (forward) or
    `C (N W)` (backward), with a fresh secret `C [n_tokens, K]` per call."""

    def __init__(self, inner: Executor, config: MaskConfig, tables: PoolTables):
        self.inner = inner
        self.config = config
        self.tables = tables
        self._noise = _Noise(config)
        self._last = _LastInput()
        # Per width: the coefficient scale that gives each token a mask of rms 1.
        self._unit = {
            w: (w / float(n.double().pow(2).sum())) ** 0.5 for w, n in tables.noises.items()
        }

    @property
    def manifest(self) -> Manifest:
        return self.inner.manifest

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        check_call(self.manifest, op, layer, x)
        _check_op(op)
        spec = self.manifest.layers[layer]
        effects = self.tables.forward if op is Op.FORWARD else self.tables.backward
        sent = self._last.reuse(x) if op is Op.FORWARD else None
        if sent is None:
            sent = self._mask(x)
            if op is Op.FORWARD:
                self._last.remember(x, sent)
        masked, coefficients = sent
        y = self.inner.call(op, layer, masked)  # [n_tokens, out] of x + m
        effect = _on(effects, spec.id, y.device)
        return torch.addmm(y, coefficients, effect, alpha=-1)

    def _mask(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + C N, C) for x [n_tokens, width], C [n_tokens, K]."""
        noise = _on(self.tables.noises, x.shape[1], x.device)
        scale = self._noise.scale(x) * self._unit[x.shape[1]]
        coefficients = self._noise.normal((x.shape[0], noise.shape[0]), x) * scale
        return torch.addmm(x, coefficients, noise), coefficients

    def close(self) -> None:
        self._last.forget()
        self.inner.close()


# -- shares ------------------------------------------------------------------------


class SharesExecutor(Executor):
    """Two executors of non-colluding parties; each call sends `x + r` to one and `-r`
    to the other (fresh full-rank `r`) and adds the replies, subtracting the bias once."""

    def __init__(
        self,
        executors: tuple[Executor, Executor],
        config: MaskConfig,
        biases: list[torch.Tensor | None],
    ):
        self.executors = executors
        self.config = config
        self.biases = biases  # per layer [out] or None
        self._noise = _Noise(config)
        self._last = _LastInput()
        # In-process executors compute on this process's cores: asking both at once
        # would only make them compete. Remote ones wait on the network: overlap them.
        remote = all(isinstance(_innermost(e), RemoteExecutor) for e in executors)
        self._worker = ThreadPoolExecutor(1, "symbiont-share") if remote else None

    @property
    def manifest(self) -> Manifest:
        return self.executors[0].manifest

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        check_call(self.manifest, op, layer, x)
        _check_op(op)
        sent = self._last.reuse(x) if op is Op.FORWARD else None
        if sent is None:
            r = self._noise.normal(x.shape, x) * self._noise.scale(x)  # [n_tokens, width]
            sent = (x + r, torch.neg(r))
            if op is Op.FORWARD:
                self._last.remember(x, sent)
        y = torch.add(*self._both(op, layer, sent))
        bias = self.biases[layer] if op is Op.FORWARD else None
        if bias is not None:  # both replies carry it; keep it once
            y.sub_(_on(self.biases, layer, y.device))
        return y

    def _both(self, op: Op, layer: int, sent: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Both parties' answers; remote parties are asked at the same time, so a call
        waits for the slower round trip rather than for the two in turn."""
        first, second = self.executors
        if self._worker is None:
            return first.call(op, layer, sent[0]), second.call(op, layer, sent[1])
        answer = self._worker.submit(second.call, op, layer, sent[1])
        return first.call(op, layer, sent[0]), answer.result()

    def close(self) -> None:
        self._last.forget()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        for executor in self.executors:
            executor.close()


def _innermost(executor: Executor) -> Executor:
    """The executor under wrappers that keep it as `inner` (counters, recorders)."""
    while isinstance(getattr(executor, "inner", None), Executor):
        executor = executor.inner
    return executor


def _biases(checkpoint: Checkpoint, manifest: Manifest, device) -> list[torch.Tensor | None]:
    cast = {"dtype": manifest.dtype, "device": device}
    return [
        None if bias is None else bias.to(**cast)
        for _, _, bias in _read_layers(checkpoint, manifest, weights=False)
    ]


# -- shared pieces -----------------------------------------------------------------


def _on(table, key, device: torch.device) -> torch.Tensor:
    """table[key] on `device`, moved there once (tables are built where the client was
    loaded; a client that moves keeps the copy on its device)."""
    tensor = table[key]
    if tensor.device != device:
        tensor = table[key] = tensor.to(device)
    return tensor


def _check_op(op: Op) -> None:
    if op not in (Op.FORWARD, Op.BACKWARD):
        raise ExecutorError(
            f"masked activations cover base-layer forward and backward calls only, not "
            f"{op.name}; load the client without mask_activations to use it"
        )


class _Noise:
    """Secret Gaussian noise, scaled to each call: `noise_scale` x the call's rms."""

    def __init__(self, config: MaskConfig):
        self.config = config
        self._generators: dict[torch.device, torch.Generator] = {}

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """The noise rms for x [n_tokens, width]: rms(x) times `noise_scale(width)`, a
        0-dim tensor (no device sync); never 0."""
        rms = x.pow(2).mean().sqrt()
        factor = noise_scale(self.config.noise_scale, x.shape[1])
        return rms.clamp_min(torch.finfo(x.dtype).tiny) * factor

    def normal(self, shape, like: torch.Tensor) -> torch.Tensor:
        generator = self._generators.get(like.device)
        if generator is None:
            generator = self._generators[like.device] = _generator(self.config.seed, like.device)
        return torch.randn(shape, generator=generator, dtype=like.dtype, device=like.device)


def noise_scale(base: float, width: int) -> float:
    """Noise rms / signal rms at `width`: `base` up to REFERENCE_WIDTH, growing with
    √(width / REFERENCE_WIDTH) above. A wider row concentrates more of its energy in any
    one direction (a token's embedding, the label's coordinate of a logits gradient)
    relative to its rms; the noise along each direction must keep pace."""
    return base * max(1.0, (width / REFERENCE_WIDTH) ** 0.5)


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


class _LastInput:
    """The last forward input and what was sent for it, so that layers fed the very same
    tensor (q/k/v, gate/up) get the very same mask. Matching is by storage, layout and
    in-place version (or content, for inference tensors that keep no version). Kept per
    thread: two threads' calls never share a mask."""

    def __init__(self) -> None:
        self._local = threading.local()

    def reuse(self, x: torch.Tensor) -> tuple | None:
        state = getattr(self._local, "state", None)  # (x, version, copy, sent)
        if state is None or not _same_layout(x, state[0]):
            return None
        seen, version, copy, sent = state
        if copy is not None:
            return sent if torch.equal(x, copy) else None
        return sent if x._version == version else None

    def remember(self, x: torch.Tensor, sent: tuple) -> None:
        if x.is_inference():
            self._local.state = (x, None, x.clone(), sent)
        else:
            self._local.state = (x, x._version, None, sent)

    def forget(self) -> None:
        self._local.state = None


def _same_layout(x: torch.Tensor, seen: torch.Tensor) -> bool:
    return (
        x.data_ptr() == seen.data_ptr()
        and x.shape == seen.shape
        and x.stride() == seen.stride()
        and x.dtype == seen.dtype
        and x.device == seen.device
    )


__all__ = [
    "MaskConfig",
    "MaskMode",
    "PoolMaskedExecutor",
    "SharesExecutor",
    "mask_config",
    "mask_executors",
    "noise_scale",
]
