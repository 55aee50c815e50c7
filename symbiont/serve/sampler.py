"""Next-token choice: greedy rows by one argmax, sampled rows with temperature and top-p."""

from __future__ import annotations

import torch

from symbiont.serve.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [n_seqs, vocab] (one row per sequence) -> one token id per sequence."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # [n_seqs]
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        index = torch.tensor(rows)
        temperature = torch.tensor([seqs[i].params.temperature for i in rows])
        top_p = torch.tensor([seqs[i].params.top_p for i in rows])
        probs = _top_p(torch.softmax(logits[index] / temperature[:, None], dim=-1), top_p)
        for j, i in enumerate(rows):  # one draw per row: each sequence has its own generator
            tokens[i] = torch.multinomial(probs[j], 1, generator=seqs[i].generator)[0]
    return tokens.tolist()


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row).
    probs [rows, vocab], top_p [rows] -> renormalised probs [rows, vocab]"""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
