"""The model runner: one flattened forward of the client model per iteration.

`prepare` turns the scheduled chunks into one `[1, n_tokens]` batch (no padding) and the
`StepContext` the attention function and adapter layers read; `forward` runs it and
returns the logits of the rows kept: the last token of every sequence that samples this
iteration and, only for requests that asked for prompt log-probabilities, every prompt
position of the chunk (its logits score the next prompt token). Index tensors are built
on the host and moved once per iteration; nothing here waits on the device.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from symbiont.serve import decode_kernel
from symbiont.serve.adapters import AdapterRegistry, adapter_batch
from symbiont.serve.attention import register_attention
from symbiont.serve.context import AttnGroup, PoolRows, StepContext, use_context
from symbiont.serve.decode_kernel import DecodeKernel
from symbiont.serve.kv_cache import PagedKVCache
from symbiont.serve.layer_ops import LayerOps
from symbiont.serve.lean import LeanForward
from symbiont.serve.scheduler import ScheduledSeq

# A decode view may compute at most this many rows per sequence it serves: rows between
# the sequences' runs are computed for nothing. At 2 per sequence the view only ties with
# gathering at 256+ tokens of context and loses 1.2-1.5x below 128 (at 1 it wins 1.2-1.9x
# below 256 and 2-4x above; benchmarks/decode_attention.py, BENCHMARKS.md issue 17).
MAX_ROWS_PER_SEQ = 1.5

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Batch:
    ids: torch.Tensor  # [n_tokens] token ids
    positions: torch.Tensor  # [n_tokens] position of each token in its sequence
    keep_rows: torch.Tensor  # [n_keep] flat rows whose logits are computed: sampling rows
    # first (one per sampling chunk, in schedule order), then the prompt-scoring rows
    n_samples: int
    prompt_spans: tuple[tuple[ScheduledSeq, int, int], ...]  # (chunk, first, end) in kept rows
    ctx: StepContext
    # prompt tuning / P-tuning: flat rows that are virtual tokens [n_virtual] and their
    # input embeddings [n_virtual, hidden]; None when no row of the iteration is one
    virtual_rows: torch.Tensor | None = None
    virtual_embeds: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class StepLogits:
    sampling: torch.Tensor  # [n_samples, vocab] one row per chunk that samples, in order
    prompt: tuple[tuple[ScheduledSeq, torch.Tensor], ...]  # chunk -> [len(prompt_rows), vocab]


def _cpu_kernels(device: torch.device) -> DecodeKernel | None:
    """symbiont's CPU kernels (built on first use), or None off a CPU or where they could
    not be built: decode attention through SDPA, norms and rotary through PyTorch."""
    if device.type != "cpu":
        return None
    kernel = decode_kernel.load()
    if kernel is None:
        log.info(
            "decode attention, norms and rotary embedding: PyTorch's operations, as "
            "symbiont's CPU kernels could not be built (%s)",
            decode_kernel.unavailable_reason(),
        )
    return kernel


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: PagedKVCache,
        adapters: AdapterRegistry,
        *,
        lean: bool = True,
        decode_kernel: bool = True,
        layer_ops: bool = True,
    ):
        self.model = model.eval()
        self.model.set_attn_implementation(register_attention())
        self.kv_cache = kv_cache
        self.adapters = adapters
        self.device = model.get_input_embeddings().weight.device
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        kernels = _cpu_kernels(self.device) if decode_kernel or layer_ops else None
        self.decode_kernel = kernels if decode_kernel else None
        self.layer_ops = LayerOps(kernels.lib) if layer_ops and kernels is not None else None
        # Llama-shaped decoders: the same submodules without transformers' wrappers
        self.lean = LeanForward.of(model, self.layer_ops) if lean else None

    def run(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        """-> the logits of the sampling rows and of the prompt-scoring rows."""
        batch = self.prepare(scheduled)
        logits = self.forward(batch)  # [n_keep, vocab]
        prompt = tuple((item, logits[a:b]) for item, a, b in batch.prompt_spans)
        return StepLogits(logits[: batch.n_samples], prompt)

    def forward(self, batch: Batch) -> torch.Tensor:
        # no_grad, not inference_mode: tensors keep a version counter, which lets the
        # VirtLayers fuse q/k/v and gate/up into one executor call (client/fusion.py)
        with torch.no_grad(), use_context(batch.ctx):
            inputs = {"input_ids": batch.ids[None]}
            embeds = None
            if batch.virtual_rows is not None:  # peft's inputs_embeds, virtual rows put in
                embeds = self.model.get_input_embeddings()(batch.ids)  # [n_tokens, hidden]
                embeds[batch.virtual_rows] = batch.virtual_embeds.to(embeds.dtype)
                inputs = {"inputs_embeds": embeds[None]}
            if self.lean is not None and self.lean.applies():
                return self.lean(batch.ids, embeds, batch.positions, batch.keep_rows)
            out = self.model(
                **inputs,
                position_ids=batch.positions[None],
                use_cache=False,
                logits_to_keep=batch.keep_rows,
            )
        return out.logits[0]

    def prepare(self, scheduled: list[ScheduledSeq]) -> Batch:
        ids, positions, slots, token_slots, sample_rows = [], [], [], [], []
        prompt_rows, spans, virtual_rows, virtual_embeds = [], [], [], []
        for item in scheduled:
            seq, start, stop = item.seq, item.start, item.start + item.n_tokens
            first = len(ids)
            if start < seq.num_virtual:  # virtual tokens first (positions 0..v-1)
                n_virtual = min(stop, seq.num_virtual) - start
                virtual_rows += range(first, first + n_virtual)
                embeds = self.adapters.virtual_tokens(seq.adapter_slot).embeds
                virtual_embeds.append(embeds[start : start + n_virtual])
                ids += [0] * n_virtual  # placeholders: their embeddings are replaced
            v = seq.num_virtual
            ids += seq.token_ids[max(start - v, 0) : max(stop - v, 0)]
            positions += range(start, stop)
            slots += self.kv_cache.slots(seq.blocks, start, stop)
            token_slots += [seq.adapter_slot] * item.n_tokens
            if item.samples:
                sample_rows.append(len(ids) - 1)
            if item.prompt_rows:
                spans.append((item, len(prompt_rows), len(prompt_rows) + len(item.prompt_rows)))
                prompt_rows += [first + p - start for p in item.prompt_rows]
        decode = [item for item in scheduled if item.n_tokens == 1]
        prefill = [item for item in scheduled if item.n_tokens > 1]
        offsets = _offsets(scheduled)
        groups = self._attn_groups(decode, prefill, offsets)
        keep = self._tensor(sample_rows + prompt_rows)
        ctx = StepContext(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(slots),
            attn_groups=groups,
            adapters=adapter_batch(
                self._tensor(token_slots), self.adapters, any_adapter=any(token_slots)
            ),
            keep_rows=keep,
            decode_kernel=self.decode_kernel,
        )
        n = len(sample_rows)
        spans = tuple((item, n + a, n + b) for item, a, b in spans)
        batch = Batch(self._tensor(ids), self._tensor(positions), keep, n, spans, ctx)
        if not virtual_rows:
            return batch
        embeds = torch.cat(virtual_embeds).to(self.device)  # [n_virtual, hidden]
        return dataclasses.replace(
            batch, virtual_rows=self._tensor(virtual_rows), virtual_embeds=embeds
        )

    def _attn_groups(
        self, decode: list[ScheduledSeq], prefill: list[ScheduledSeq], offsets: dict[int, int]
    ) -> tuple[AttnGroup, ...]:
        """The decoding sequences (those read in place from the pool, and the rest), one
        group per prefill chunk: no query padding, a chunk that starts its sequence
        attends over its own keys and a later chunk on a run reads its context in place,
        both without a gather."""
        groups = []
        in_place = self._pool_rows(decode)
        if in_place is not None:
            members, plan = in_place
            groups.append(self._attn_group(members, 1, offsets, plan))
            chosen = {id(item) for item in members}
            decode = [item for item in decode if id(item) not in chosen]
        if decode:
            groups.append(self._attn_group(decode, 1, offsets))
        for item in prefill:
            plan = None
            if item.start > 0 and self.kv_cache.allocator.is_run(item.seq.blocks):
                first = item.seq.blocks[0] * self.kv_cache.block_size  # its context, in place
                plan = _RowsPlan(first, 0, 1, [0])
            groups.append(self._attn_group([item], item.n_tokens, offsets, plan))
        return tuple(groups)

    def _pool_rows(self, decode: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], _RowsPlan] | None:
        """The decoding sequences read in place as rows of one strided view of the pool,
        and the view; None when none qualifies.

        A sequence qualifies when its blocks are one run the allocator aligned to its size
        class (kv_cache.py). The view's row stride is one class's alignment; sequences
        whose runs start on that lattice are its rows. The class giving the most rows is
        chosen, provided the view computes at most `MAX_ROWS_PER_SEQ` rows per sequence
        (rows that are no sequence are computed for nothing) and stays inside the pool."""
        allocator, block = self.kv_cache.allocator, self.kv_cache.block_size
        runs = [item for item in decode if allocator.is_run(item.seq.blocks)]
        best = None
        aligns = {allocator.alignment(len(item.seq.blocks)) for item in runs}
        for align in sorted(aligns, reverse=True):  # ties: the wider stride, fewer rows
            members = [item for item in runs if item.seq.blocks[0] % align == 0]
            if not members:  # runs of this class that fit only unaligned
                continue
            firsts = [item.seq.blocks[0] for item in members]
            lo, hi = min(firsts), max(firsts)
            n_rows = (hi - lo) // align + 1
            width = max(item.start + 1 for item in members)
            if n_rows > MAX_ROWS_PER_SEQ * len(members) or hi * block + width > (
                self.kv_cache.num_slots
            ):
                continue
            if best is None or len(members) > len(best[0]):
                index = [(first - lo) // align for first in firsts]
                best = (members, _RowsPlan(lo * block, align * block, n_rows, index))
        return best

    def _attn_group(
        self,
        items: list[ScheduledSeq],
        n_queries: int,
        offsets: dict[int, int],
        plan: _RowsPlan | None = None,
    ) -> AttnGroup:
        """`items` all compute `n_queries` tokens this iteration; with `plan` (sequences
        whose context is read in place), positions and lengths are laid out per view row."""
        firsts = [offsets[id(item)] for item in items]
        starts = [item.start for item in items]
        first, n_tokens = firsts[0], len(items) * n_queries
        contiguous = firsts == list(range(first, first + n_tokens, n_queries))
        step = torch.arange(n_queries)  # [n_queries]
        start = torch.tensor(starts)  # [n_seqs]
        q_pos = start[:, None] + step[None, :]  # [n_seqs, n_queries]
        kv_len = start + n_queries  # [n_seqs]
        fresh = len(items) == 1 and starts[0] == 0  # context = this chunk's own keys
        tokens = None
        if not contiguous:
            tokens = (torch.tensor(firsts)[:, None] + step[None, :]).flatten().to(self.device)
        rows = None
        if plan is not None:  # a row that is no sequence attends to position 0 only
            index = torch.tensor(plan.index)
            q_pos = torch.zeros(plan.n_rows, n_queries, dtype=torch.long).index_copy_(
                0, index, q_pos
            )
            kv_len = torch.ones(plan.n_rows, dtype=torch.long).index_copy_(0, index, kv_len)
            blocks, kv_width = None, max(starts) + n_queries
            in_order = plan.index == list(range(plan.n_rows))
            rows = PoolRows(plan.first, plan.stride, plan.n_rows, index.to(self.device), in_order)
        elif fresh:
            blocks, kv_width = None, n_queries
        else:
            blocks, n_blocks = self._block_table(items, max(starts) + n_queries)
            kv_width = n_blocks * self.kv_cache.block_size
        return AttnGroup(
            n_seqs=len(items),
            n_queries=n_queries,
            span=(first, first + n_tokens) if contiguous else None,
            tokens=tokens,
            blocks=blocks,
            kv_width=kv_width,
            q_pos=q_pos.to(self.device),
            kv_len=kv_len.to(self.device),
            rows=rows,
            start=starts[0] if len(items) == 1 else None,
        )

    def _block_table(self, items: list[ScheduledSeq], max_kv: int) -> tuple[torch.Tensor, int]:
        """-> ([n_seqs * n_blocks] KV block of every context block, padding -> block 0;
        n_blocks), enough blocks for `max_kv` positions."""
        n_blocks = self.kv_cache.blocks_for(max_kv)
        table = []
        for item in items:
            used = item.seq.blocks[:n_blocks]
            table += used
            table += [0] * (n_blocks - len(used))
        return self._tensor(table), n_blocks

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class _RowsPlan:
    """Where the in-place decode view lies (PoolRows before its index becomes a tensor)."""

    first: int  # pool slot of row 0
    stride: int  # slots between rows
    n_rows: int
    index: list[int]  # view row of each member sequence


def _offsets(scheduled: list[ScheduledSeq]) -> dict[int, int]:
    """id(item) -> flat index of the item's first token this iteration."""
    offsets, total = {}, 0
    for item in scheduled:
        offsets[id(item)] = total
        total += item.n_tokens
    return offsets
