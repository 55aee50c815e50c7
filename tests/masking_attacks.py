"""A curious executor: it records every tensor it receives and tries to read the client's
activations and gradients out of them (docs/privacy.md). Shared by the attack tests and
benchmarks/masking.py, which prints the attack table."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from symbiont.protocol.executor import Executor, Op


@dataclass(frozen=True)
class Received:
    op: Op
    layer: int
    x: torch.Tensor  # [n_tokens, width] as the executor got it (float64 copy)


class Recorder(Executor):
    """An executor that serves honestly and keeps a copy of everything it is sent."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.calls: list[Received] = []

    @property
    def manifest(self):
        return self.inner.manifest

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(Received(op, layer, x.detach().double().clone()))
        return self.inner.call(op, layer, x)


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """|Pearson r| between two tensors' elements (0 when either is constant)."""
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    norm = a.norm() * b.norm()
    return 0.0 if norm == 0 else abs(float(a @ b / norm))


def single_tensor_attack(received: list[Received], true: list[Received]) -> float:
    """The largest |r| between a received tensor and the true tensor of the same call."""
    return max(pearson(r.x, t.x) for r, t in zip(received, true, strict=True))


def difference_attack(received: list[Received], true: list[Received]) -> float:
    """The largest |r| between the difference of two received tensors of the same shape
    and either call's true tensor (or their true difference). Identical received tensors
    (layers fed one input get one mask) differ by zero, which says nothing."""
    best = 0.0
    for (ri, ti), (rj, tj) in _pairs(list(zip(received, true, strict=True))):
        diff = ri.x - rj.x
        if not diff.any():
            continue
        best = max(best, pearson(diff, ti.x), pearson(diff, tj.x), pearson(diff, ti.x - tj.x))
    return best


def _pairs(calls):
    """Pairs worth subtracting: two calls of one layer (masks of different steps), and
    two consecutive calls of the same shape (neighbouring layers of one step)."""
    by_layer: dict = {}
    for call in calls:
        by_layer.setdefault((call[0].op, call[0].layer), []).append(call)
    for group in by_layer.values():
        yield from itertools.combinations(group, 2)
    for before, after in itertools.pairwise(calls):
        if before[0].x.shape == after[0].x.shape and before[0].layer != after[0].layer:
            yield before, after


def stacked(calls: list[Received], op: Op, layer: int) -> torch.Tensor:
    """Every tensor of `layer` in direction `op`, rows concatenated [n_tokens, width]."""
    return torch.cat([c.x for c in calls if c.op is op and c.layer == layer])


def principal_directions(recording: torch.Tensor) -> torch.Tensor:
    """Right singular vectors of the centred recording, strongest first [width, width]."""
    centred = recording - recording.mean(dim=0)
    values, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending
    return vectors.flip(dims=(1,))


def pca_attack(recording: torch.Tensor, truth: torch.Tensor, ks) -> dict[int, float]:
    """|r| with the truth of the best principal-component estimate per k: keeping the
    top-k components (strong signal), or removing them (strong noise, as a pooled mask
    puts in K directions). ks: the numbers of components to try."""
    vectors = principal_directions(recording)
    centred = recording - recording.mean(dim=0)
    scores = {}
    for k in ks:
        top = vectors[:, :k]
        kept = centred @ top @ top.T
        removed = centred - kept
        scores[k] = max(pearson(kept, truth), pearson(removed, truth))
    return scores


def remove_subspace_attack(recording: torch.Tensor, truth: torch.Tensor, k: int) -> float:
    """|r| with the truth after projecting away the top-k principal directions (the
    attack on a pool of k noises)."""
    vectors = principal_directions(recording)[:, :k]
    centred = recording - recording.mean(dim=0)
    return pearson(centred - centred @ vectors @ vectors.T, truth)


def layers_of(calls: list[Received]) -> set[tuple[Op, int]]:
    return {(c.op, c.layer) for c in calls}
