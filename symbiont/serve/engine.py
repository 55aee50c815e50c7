"""The serving engine: continuous batching of many adapters over one client model.

Each iteration flattens the scheduled tokens of every sequence (decode tokens and
prefill chunks alike) into one `[1, n_tokens]` forward of the client model, so every
base layer makes one executor call for the whole batch. Per-sequence attention comes
from the paged KV cache (`attention.py`), per-token adapters from `AdapterLayer`s
(`adapters.py`), both driven by one `StepContext` built here.

`Engine` is synchronous and single-threaded: `add_request`, `step`, `abort`,
`load_adapter`, `unload_adapter` must be called from one thread (`AsyncEngine` owns
that thread when serving).
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from symbiont.generation import held_back
from symbiont.serve.adapters import AdapterRegistry, AdapterWeights, adapter_batch
from symbiont.serve.attention import register_attention
from symbiont.serve.config import EngineConfig
from symbiont.serve.context import AttnGroup, StepContext, use_context
from symbiont.serve.kv_cache import PagedKVCache
from symbiont.serve.sampler import sample
from symbiont.serve.scheduler import ScheduledSeq, Scheduler
from symbiont.serve.sequence import (
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    SeqDelta,
    Sequence,
)

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request cannot be served as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineObserver:
    """Receives timing events (the Prometheus metrics implement it); no-op by default."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_inter_token(self, seconds: float) -> None: ...

    def on_tokens(self, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class _Batch:
    ids: torch.Tensor  # [n_tokens] token ids
    positions: torch.Tensor  # [n_tokens] position of each token in its sequence
    sample_rows: torch.Tensor  # [n_samples] flat index of the last token of each sampling sequence
    ctx: StepContext


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig | None = None,
        tokenizer=None,
        observer: EngineObserver | None = None,
    ):
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.model.set_attn_implementation(register_attention())
        self.tokenizer = tokenizer
        self.observer = observer or EngineObserver()
        self.device = model.get_input_embeddings().weight.device
        self.max_model_len = self._max_model_len(model)
        self.kv_cache = PagedKVCache(self.config.num_blocks, self.config.block_size, self.device)
        self.adapters = AdapterRegistry(model, self.config)
        self.scheduler = Scheduler(self.config, self.kv_cache, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.eos_ids = _eos_ids(model)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        executor=None,
        config: EngineConfig | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        observer: EngineObserver | None = None,
    ) -> Engine:
        """An engine on the checkpoint at `path`; base layers run on `executor`
        (default: an in-process `BaseExecutor` of the same checkpoint)."""
        from transformers import AutoTokenizer

        from symbiont import BaseExecutor, load_client

        executor = executor or BaseExecutor.from_pretrained(path, device=device, dtype=dtype)
        model = load_client(path, executor, device=device, dtype=dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            log.warning("no tokenizer in %s (%s); only token-id prompts are accepted", path, err)
            tokenizer = None
        return cls(model, config, tokenizer, observer)

    def _max_model_len(self, model) -> int:
        limit = self.config.max_model_len or getattr(model.config, "max_position_embeddings", None)
        return min(limit or self.config.kv_capacity_tokens, self.config.kv_capacity_tokens)

    # -- adapters ---------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | os.PathLike) -> AdapterWeights:
        weights = self.adapters.parse(path)
        self.adapters.add(name, weights)
        return weights

    def unload_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestError (bad input), AdapterNotFound or QueueFull."""
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use", "id")
        self._validate(request)
        slot = self.adapters.acquire(request.adapter) if request.adapter else 0
        request.sequences = [self._sequence(request, i, slot) for i in range(request.params.n)]
        try:
            self.scheduler.add(request.sequences)
        except Exception:
            self._release(slot)
            raise
        self.requests[request.request_id] = request

    def _validate(self, request: Request) -> None:
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context of {self.max_model_len} tokens; shorten the "
                "prompt or lower max_tokens",
                "max_tokens",
            )
        if self.kv_cache.blocks_for(total) > self.config.num_blocks:
            raise RequestError(
                f"{total} tokens need more KV blocks than the cache holds "
                f"({self.config.num_blocks} x {self.config.block_size}); lower max_tokens",
                "max_tokens",
            )

    def _sequence(self, request: Request, index: int, slot: int) -> Sequence:
        params = request.params
        generator = None
        if not params.greedy:
            seed = params.seed + index if params.seed is not None else random.getrandbits(63)
            generator = torch.Generator().manual_seed(seed)
        prompt = list(request.prompt_ids)
        return Sequence(request.request_id, index, len(prompt), prompt, params, slot, generator)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; None if it already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(seq)
        return self._retire(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration over everything scheduled; returns what changed."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        try:
            logits = self._forward(self._prepare(scheduled))  # [n_samples, vocab]
        except Exception as err:  # noqa: BLE001 - the batch's requests fail, the server goes on
            log.exception("iteration failed")
            return self._fail_all({s.seq.request_id for s in scheduled}, f"iteration failed: {err}")
        return self._advance(scheduled, logits)

    def _forward(self, batch: _Batch) -> torch.Tensor:
        with torch.inference_mode(), use_context(batch.ctx):
            out = self.model(
                input_ids=batch.ids[None],
                position_ids=batch.positions[None],
                use_cache=False,
                logits_to_keep=batch.sample_rows,
            )
        return out.logits[0]

    def _prepare(self, scheduled: list[ScheduledSeq]) -> _Batch:
        ids, positions, slots, token_slots, sample_rows = [], [], [], [], []
        for item in scheduled:
            seq, start, stop = item.seq, item.start, item.start + item.n_tokens
            ids += seq.token_ids[start:stop]
            positions += range(start, stop)
            slots += self.kv_cache.slots(seq.blocks, start, stop)
            token_slots += [seq.adapter_slot] * item.n_tokens
            if item.samples:
                sample_rows.append(len(ids) - 1)
        decode = [item for item in scheduled if item.n_tokens == 1]
        prefill = [item for item in scheduled if item.n_tokens > 1]
        offsets = _offsets(scheduled)
        groups = tuple(self._attn_group(g, offsets) for g in (decode, prefill) if g)
        ctx = StepContext(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(slots),
            attn_groups=groups,
            adapters=adapter_batch(self._tensor(token_slots), self.adapters),
        )
        return _Batch(self._tensor(ids), self._tensor(positions), self._tensor(sample_rows), ctx)

    def _attn_group(self, items: list[ScheduledSeq], offsets: dict[int, int]) -> AttnGroup:
        max_q = max(item.n_tokens for item in items)
        q_index = torch.zeros(len(items), max_q, dtype=torch.long)
        q_valid = torch.zeros(len(items), max_q, dtype=torch.bool)
        q_pos = torch.zeros(len(items), max_q, dtype=torch.long)
        for row, item in enumerate(items):
            n, first = item.n_tokens, offsets[id(item)]
            q_index[row, :n] = torch.arange(first, first + n)
            q_valid[row, :n] = True
            q_pos[row, :n] = torch.arange(item.start, item.start + n)
        kv_len = torch.tensor([item.start + item.n_tokens for item in items])
        kv_slots = self._kv_slots(items, int(kv_len.max()))
        q_valid = q_valid.flatten()
        return AttnGroup(
            q_index=q_index.to(self.device),
            q_valid=q_valid.to(self.device),
            q_tokens=q_index.flatten()[q_valid].to(self.device),
            kv_slots=kv_slots,
            q_pos=q_pos.to(self.device),
            kv_len=kv_len.to(self.device),
        )

    def _kv_slots(self, items: list[ScheduledSeq], max_kv: int) -> torch.Tensor:
        """-> [n_seqs, max_kv] cache slot of every context position (padding -> block 0)."""
        size = self.config.block_size
        n_blocks = self.kv_cache.blocks_for(max_kv)
        table = torch.zeros(len(items), n_blocks, dtype=torch.long)
        for row, item in enumerate(items):
            used = item.seq.blocks[: min(n_blocks, len(item.seq.blocks))]
            table[row, : len(used)] = torch.tensor(used)
        pos = torch.arange(max_kv)
        slots = table[:, pos // size] * size + pos % size  # [n_seqs, max_kv]
        return slots.to(self.device)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # -- after the forward ------------------------------------------------------------

    def _advance(self, scheduled: list[ScheduledSeq], logits: torch.Tensor) -> list[RequestOutput]:
        sampling = [item.seq for item in scheduled if item.samples]
        for item in scheduled:
            item.seq.num_computed += item.n_tokens
        tokens = sample(logits, sampling)
        now = time.monotonic()
        new: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, token in zip(sampling, tokens, strict=True):
            new.setdefault(seq.request_id, []).append((seq, token))
        outputs = []
        for request_id, produced in new.items():
            request = self.requests[request_id]
            try:
                outputs.append(self._append(request, produced, now))
            except Exception as err:  # noqa: BLE001 - one request's failure stays its own
                log.exception("request %s failed", request_id)
                outputs.append(self._fail(request, f"request failed: {err}"))
        self.observer.on_tokens(len(tokens))
        return outputs

    def _append(self, request: Request, produced, now: float) -> RequestOutput:
        if request.first_token_time is None:
            request.first_token_time = now
            self.observer.on_first_token(now - request.arrival)
        deltas = []
        for seq, token in produced:
            if seq.last_token_time is not None:
                self.observer.on_inter_token(now - seq.last_token_time)
            seq.last_token_time = now
            seq.token_ids.append(token)
            seq.finish_reason = self._finish_reason(seq, token)
            text = self._detokenize(seq)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            deltas.append(SeqDelta(seq.index, (token,), text, seq.finish_reason))
        if request.finished:
            return self._retire(request, tuple(deltas))
        return self._output(request, tuple(deltas))

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _detokenize(self, seq: Sequence) -> str:
        """Update seq.text; return the newly safe text (stop strings held back until known)."""
        if self.tokenizer is None:
            return ""
        ids = seq.output_ids
        if seq.finish_reason is FinishReason.STOP and ids and ids[-1] in self._stop_ids(seq):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = seq.params.stop
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.STOP
        seq.text = text
        safe = len(text) if seq.finish_reason else len(text) - held_back(text, stops)
        delta = text[seq.sent_chars : max(safe, seq.sent_chars)]
        seq.sent_chars = max(safe, seq.sent_chars)
        return delta

    def _stop_ids(self, seq: Sequence) -> set[int]:
        return set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_ids)

    def _output(self, request: Request, deltas: tuple[SeqDelta, ...], finished=False):
        completion = sum(len(s.output_ids) for s in request.sequences)
        return RequestOutput(
            request.request_id,
            deltas,
            len(request.prompt_ids),
            completion,
            finished,
            request.error,
        )

    def _retire(self, request: Request, deltas: tuple[SeqDelta, ...] = ()) -> RequestOutput:
        """A finished request leaves the engine and gives its adapter slot back."""
        self.requests.pop(request.request_id, None)
        self._release(request.sequences[0].adapter_slot if request.sequences else 0)
        return self._output(request, deltas, finished=True)

    def _release(self, slot: int) -> None:
        if slot:
            self.adapters.release(slot)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        request.error = message
        for seq in request.sequences:
            if not seq.finished:
                seq.finish_reason = FinishReason.ERROR
                self.scheduler.finish(seq)
        return self._retire(request)

    def _fail_all(self, request_ids: set[str], message: str) -> list[RequestOutput]:
        return [self._fail(self.requests[r], message) for r in request_ids if r in self.requests]

    # -- convenience ------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        adapters: list[str | None] | None = None,
        params: SamplingParams | None = None,
    ) -> list[list[int]]:
        """Run prompts to completion (greedy by default); generated token ids per prompt."""
        params = params or SamplingParams(temperature=0.0)
        adapters = adapters or [None] * len(prompts)
        requests = [
            Request(f"generate-{time.monotonic_ns()}-{i}", prompt, adapter, params)
            for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True))
        ]
        for request in requests:
            self.add_request(request)
        while not all(r.finished for r in requests):
            self.step()
        failed = [r.error for r in requests if r.error]
        if failed:
            raise RuntimeError(f"generation failed: {failed[0]}")
        return [r.sequences[0].output_ids for r in requests]


def _offsets(scheduled: list[ScheduledSeq]) -> dict[int, int]:
    """id(item) -> flat index of the item's first token this iteration."""
    offsets, total = {}, 0
    for item in scheduled:
        offsets[id(item)] = total
        total += item.n_tokens
    return offsets


def _eos_ids(model: PreTrainedModel) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list | tuple) else {int(eos)}
