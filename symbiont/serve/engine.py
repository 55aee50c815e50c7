"""The serving engine: continuous batching of many adapters over one client model.

A thin coordinator, nano-vllm style: each `step` asks the `Scheduler` what runs, the
`ModelRunner` flattens it into one `[1, n_tokens]` forward (so every base layer makes
one executor call for the whole batch) and returns the logits of the sampling rows (and
of the prompt rows of requests that asked for prompt log-probabilities),
`symbiont.decoding.sample` picks the tokens, `symbiont.decoding.token_logprobs` scores
them where asked, and the `OutputProcessor` applies the stop rule and produces text
deltas. A failure in one step fails that step's requests; the engine goes on.

Log-probabilities are the log-softmax of the raw logits (before temperature, top-k,
top-p), as vLLM returns by default. A request with `max_tokens` 0 (and
`prompt_logprobs`) ends as soon as its prompt is scored, with finish reason "length".

`Engine` is synchronous and single-threaded: `add_request`, `step`, `abort`,
`load_adapter`, `unload_adapter` must be called from one thread (`AsyncEngine` owns
that thread when serving).

Adapters come two ways: loaded by name (`load_adapter`: `--adapter`, POST
/v1/adapters), pinned in a slot until unloaded; or from a folder (`attach_adapter_dir`:
`--adapter-dir`), served through the `AdapterCache` (disk, host, resident tiers), loaded
on first use off this thread and placed in a slot when the scheduler admits a request.
A name loaded by name shadows the folder's adapter of that name.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from transformers import PreTrainedModel

from symbiont.decoding import (
    TextTracker,
    TokenLogprob,
    eos_token_ids,
    make_generator,
    sample,
    token_logprobs,
)
from symbiont.protocol.executor import ExecutorUnavailable
from symbiont.serve.adapter_cache import AdapterCache
from symbiont.serve.adapters import AdapterError, AdapterRegistry, AdapterWeights
from symbiont.serve.config import EngineConfig
from symbiont.serve.kv_cache import PagedKVCache
from symbiont.serve.model_runner import ModelRunner, StepLogits
from symbiont.serve.output import EngineObserver, OutputProcessor, request_output
from symbiont.serve.scheduler import ScheduledSeq, Scheduler
from symbiont.serve.sequence import FinishReason, Request, RequestOutput, SamplingParams, Sequence

__all__ = ["Engine", "EngineObserver", "RequestError"]

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request cannot be served as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig | None = None,
        tokenizer=None,
        observer: EngineObserver | None = None,
    ):
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        device = model.get_input_embeddings().weight.device
        self.max_model_len = self._max_model_len(model)
        self.kv_cache = PagedKVCache(self.config.num_blocks, self.config.block_size, device)
        self.adapters = AdapterRegistry(model, self.config)
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            self.adapters,
            lean=self.config.lean_forward,
            decode_kernel=self.config.decode_kernel,
            layer_ops=self.config.layer_ops,
        )
        self.scheduler = make_scheduler(
            self.config, self.kv_cache, self.max_model_len, self.adapters.virtual_tokens
        )
        eos = eos_token_ids(model, tokenizer)
        self.output = OutputProcessor(eos, self.max_model_len, observer or EngineObserver())
        self.requests: dict[str, Request] = {}
        # (time.monotonic(), message) of the last iteration a lost executor failed, until
        # one succeeds: /health reports it (symbiont/serve/http/api.py)
        self.executor_lost: tuple[float, str] | None = None
        self.stalled = False  # the last step found nothing to run (adapters loading)
        self.cache: AdapterCache | None = None
        self.deltas = None  # DeltaServer, once a delta is loaded
        self._failures_seen = 0  # cache.failures already turned into failed requests
        # called after each iteration with (tokens run, seconds): co-serving hands a
        # fine-tuning job its slot there (symbiont/jobs/coserve.py)
        self.iteration_hook = None

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
        from symbiont.tenant import open_client, open_executor

        executor = executor or open_executor(path, device=device, dtype=dtype)
        model, tokenizer = open_client(
            path, executor, device=device, dtype=dtype, need_tokenizer=False
        )
        return cls(model, config, tokenizer, observer)

    def _max_model_len(self, model) -> int:
        limit = self.config.max_model_len or getattr(model.config, "max_position_embeddings", None)
        return min(limit or self.config.kv_capacity_tokens, self.config.kv_capacity_tokens)

    @property
    def model(self) -> PreTrainedModel:
        return self.runner.model

    @property
    def observer(self) -> EngineObserver:
        return self.output.observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self.output.observer = observer
        if self.cache is not None:
            self.cache.observer = observer

    # -- adapters ---------------------------------------------------------------------

    def attach_adapter_dir(self, root: str | os.PathLike) -> AdapterCache:
        """Serve every adapter folder under `root` by its folder name (scanned now)."""
        named = len(self.adapters.names())
        if named >= self.config.max_adapters:
            raise AdapterError(
                f"--adapter-dir needs a free adapter slot, but the {named} adapters and deltas "
                f"loaded by name fill all --max-loras {self.config.max_adapters}; raise "
                "--max-loras"
            )
        self.cache = AdapterCache(self.adapters, root, self.config, self.observer)
        self.cache.scan()
        self.scheduler.cache = self.cache
        return self.cache

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def load_adapter(self, name: str, path: str | os.PathLike) -> AdapterWeights:
        weights = self.adapters.parse(path)
        self._make_room_for_named(name)
        self.adapters.add(name, weights)
        return weights

    def _make_room_for_named(self, name: str) -> None:
        """With --adapter-dir, an adapter loaded by name takes a slot the cache's may hold
        (an idle one is evicted for it), and never the last one: folder adapters would
        then wait for a slot forever."""
        if self.cache is None or name in self.adapters.names():
            return  # no cache, or `add` refuses the name anyway
        named, slots = len(self.adapters.names()), self.config.max_adapters
        if named + 1 >= slots:
            raise AdapterError(
                f"loading {name!r} would leave no adapter slot for --adapter-dir's adapters "
                f"({named} of --max-loras {slots} are loaded by name); unload one first, or "
                "restart with a larger --max-loras"
            )
        if self.adapters.num_free_slots == 0 and not self.cache.evict_idle():
            raise AdapterError(
                "every adapter slot is in use by running requests; retry when they finish"
            )

    def load_delta(
        self,
        name: str,
        path: str | os.PathLike,
        base: str | os.PathLike | None = None,
        mode: str | None = None,
    ) -> int:
        """Serve the compressed full fine-tune at `path` (made against the checkpoint
        `base`, default the served one) under `name`, per row beside the adapters, applied
        `mode` ("exact" or "merged", default `config.delta_mode`); returns its slot."""
        from symbiont.serve.deltas import DeltaServer

        self.deltas = DeltaServer.of(self.adapters)
        self._make_room_for_named(name)
        return self.deltas.load(name, path, mode or self.config.delta_mode, base)

    def unload_adapter(self, name: str) -> None:
        if self.deltas is not None and name in self.deltas.loaded:
            raise AdapterError(f"{name!r} is a delta given with --delta; it stays loaded")
        self.adapters.remove(name)

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestError (bad input), AdapterNotFound or QueueFull."""
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use", "id")
        self._validate(request)
        name, cached = request.adapter, self._from_folder(request.adapter)
        slot, rank = 0, 0
        if cached:
            self.cache.reserve(name, count=not request.adapter_counted)  # prefetch if on disk
            rank = self.cache.lookup(name).rank
        elif name:
            slot = self.adapters.acquire(name)
            rank = self.adapters.info(name)["rank"]
        request.sequences = [self._sequence(request, i, slot) for i in range(request.params.n)]
        for seq in request.sequences:
            seq.cached_adapter, seq.adapter_rank = (name if cached else None), rank
        request.prompt_logprobs = None if request.params.prompt_logprobs is None else [None]
        try:
            self.scheduler.add(request.sequences)
        except Exception:
            self._release_adapter(request)
            raise
        self.requests[request.request_id] = request
        self.output.observer.on_request(name)

    def _from_folder(self, name: str | None) -> bool:
        """Whether `name` is served by the adapter cache (not loaded by name)."""
        return bool(name) and self.cache is not None and name not in self.adapters.names()

    def _validate(self, request: Request) -> None:
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.n > self.config.max_queue:  # a 429 would tell it to retry for ever
            raise RequestError(
                f"n ({params.n}) is more sequences than this server queues at once "
                f"(--max-queue {self.config.max_queue}); lower n",
                "n",
            )
        virtual = self.virtual_count(request.adapter)  # prompt/prefix tuning positions
        total = len(prompt) + params.max_tokens + virtual
        if total > self.max_model_len:
            also = f" + the adapter's {virtual} virtual tokens" if virtual else ""
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}){also} = "
                f"{total} exceeds the model's context of {self.max_model_len} tokens; shorten "
                "the prompt or lower max_tokens",
                "max_tokens",
            )
        if self.kv_cache.blocks_for(total) > self.config.num_blocks:
            raise RequestError(
                f"{total} tokens need more KV blocks than the cache holds "
                f"({self.config.num_blocks} x {self.config.block_size}); lower max_tokens",
                "max_tokens",
            )

    def virtual_count(self, name: str | None) -> int:
        """Positions a prompt-learning adapter puts before each prompt (0 for others).
        A folder adapter's count is read from its config (cheap; only for such methods)."""
        from symbiont.adapters.spec import read_adapter
        from symbiont.serve.virtual_tokens import PROMPT_METHODS

        if not name:
            return 0
        if not self._from_folder(name):
            if name not in self.adapters.names():
                return 0  # unknown: add_request answers AdapterNotFound
            tokens = self.adapters.virtual_tokens(self.adapters.info(name)["slot"])
            return 0 if tokens is None else tokens.count
        entry = self.cache.lookup(name)
        if entry is None or entry.method not in PROMPT_METHODS:
            return 0
        try:
            return read_adapter(entry.path, require_weights=False).config.num_virtual_tokens
        except Exception:  # noqa: BLE001 - a broken folder fails through the cache, by name
            return 0

    def _sequence(self, request: Request, index: int, slot: int) -> Sequence:
        params, prompt = request.params, list(request.prompt_ids)
        text = TextTracker(self.tokenizer, params.stop) if self.tokenizer is not None else None
        generator = make_generator(params, index)
        return Sequence(
            request.request_id, index, len(prompt), prompt, params, slot, generator, text
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; None if it already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish_all(request, FinishReason.ABORT)
        return self._retire(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one iteration ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration over everything scheduled; returns what changed."""
        if self.cache is not None:
            self.cache.drop_stale()  # folders changed or removed since they were loaded
        failed = self._fail_unloadable()
        scheduled = self.scheduler.schedule()
        self.stalled = not scheduled
        if not scheduled:
            return failed
        started = time.perf_counter()
        outputs = failed + self._run(scheduled)
        if self.iteration_hook is not None:
            tokens = sum(item.n_tokens for item in scheduled)
            try:
                self.iteration_hook(tokens, time.perf_counter() - started)
            except Exception:  # a bug in the pacing of jobs must not stop inference
                log.exception(
                    "co-serving's iteration hook failed; fine-tuning jobs now run beside "
                    "inference without pacing (restart the server to pace them again)"
                )
                self.iteration_hook = None
        return outputs

    def _fail_unloadable(self) -> list[RequestOutput]:
        """Fail the waiting requests whose folder adapter failed to load."""
        if self.cache is None or self.cache.failures == self._failures_seen:
            return []
        self._failures_seen = self.cache.failures
        bad = self.cache.failed_names()
        doomed = {s.request_id for s in self.scheduler.waiting if s.cached_adapter in bad}
        outputs = []
        for request_id in doomed:
            request = self.requests[request_id]
            name = request.adapter
            reason = self.cache.lookup(name).reason if self.cache.lookup(name) else "unknown"
            outputs.append(self._fail(request, f"adapter {name!r} cannot be served: {reason}"))
        return outputs

    def _run(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        sampling = [item.seq for item in scheduled if item.samples]
        try:
            logits = self.runner.run(scheduled)
            tokens = sample(
                logits.sampling, [s.params for s in sampling], [s.generator for s in sampling]
            )
            logprobs = _sampled_logprobs(logits.sampling, sampling, tokens)
            self._score_prompts(logits)
        except ExecutorUnavailable as err:  # said in full by its message: no traceback
            log.error("iteration failed: %s", err)
            self.executor_lost = (time.monotonic(), str(err))
            return self._fail_all({s.seq.request_id for s in scheduled}, f"iteration failed: {err}")
        except Exception as err:  # noqa: BLE001 - the batch's requests fail, the server goes on
            log.exception("iteration failed")
            return self._fail_all({s.seq.request_id for s in scheduled}, f"iteration failed: {err}")
        self.executor_lost = None
        scored = [item.seq for item in scheduled if item.reaches_end and not item.samples]
        return self._advance(scheduled, sampling, tokens, logprobs, scored)

    def _score_prompts(self, logits: StepLogits) -> None:
        """Append the log-probabilities of the prompt tokens this iteration's chunks
        predict to their requests (one batched log-softmax for all of them)."""
        if not logits.prompt:
            return
        targets, top_n = [], []
        for item, _ in logits.prompt:
            n = item.seq.params.prompt_logprobs
            targets += [item.seq.token_ids[p - item.seq.num_virtual + 1] for p in item.prompt_rows]
            top_n += [n] * len(item.prompt_rows)
        rows = torch.cat([rows for _, rows in logits.prompt])  # [n_rows, vocab]
        scores = iter(token_logprobs(rows, targets, top_n))
        for item, _ in logits.prompt:
            request = self.requests[item.seq.request_id]
            request.prompt_logprobs += [next(scores) for _ in item.prompt_rows]

    def _advance(
        self,
        scheduled: list[ScheduledSeq],
        sampling: list[Sequence],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
        scored: list[Sequence],
    ) -> list[RequestOutput]:
        """`scored`: prompt-only sequences (max_tokens 0) whose prompt is now scored."""
        for item in scheduled:
            item.seq.num_computed += item.n_tokens
        produced: dict[str, list[tuple[Sequence, int | None, TokenLogprob | None]]] = {}
        for seq, token, logprob in zip(sampling, tokens, logprobs, strict=True):
            produced.setdefault(seq.request_id, []).append((seq, token, logprob))
        for seq in scored:
            produced.setdefault(seq.request_id, []).append((seq, None, None))
        outputs = []
        for request_id, items in produced.items():
            request = self.requests[request_id]
            try:
                deltas = self.output.append(request, items, self.scheduler.finish)
            except Exception as err:  # noqa: BLE001 - one request's failure stays its own
                log.exception("request %s failed", request_id)
                outputs.append(self._fail(request, f"request failed: {err}"))
                continue
            done = request.finished
            outputs.append(
                self._retire(request, deltas) if done else request_output(request, deltas, False)
            )
        self.output.observer.on_tokens(len(tokens))
        return outputs

    def _retire(self, request: Request, deltas=()) -> RequestOutput:
        """A finished request leaves the engine and gives its adapter slot back."""
        self.requests.pop(request.request_id, None)
        self._release_adapter(request)
        return request_output(request, tuple(deltas), finished=True)

    def _release_adapter(self, request: Request) -> None:
        """Give back the request's adapter: its pinned slot, or its cached adapter's
        reference and each sequence's slot."""
        seqs = request.sequences
        if not seqs:
            return
        name = seqs[0].cached_adapter
        if name is None:
            self._release(seqs[0].adapter_slot)
            return
        for seq in seqs:
            self._release(seq.adapter_slot)
            seq.adapter_slot = 0
        self.cache.release(name)

    def _release(self, slot: int) -> None:
        if slot:
            self.adapters.release(slot)

    def _finish_all(self, request: Request, reason: FinishReason) -> None:
        for seq in request.sequences:
            if not seq.finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        request.error = message
        self._finish_all(request, FinishReason.ERROR)
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
            if self.stalled:
                time.sleep(0.001)  # adapters loading on another thread
        failed = [r.error for r in requests if r.error]
        if failed:
            raise RuntimeError(f"generation failed: {failed[0]}")
        return [r.sequences[0].output_ids for r in requests]


def make_scheduler(
    config: EngineConfig, kv_cache: PagedKVCache, max_model_len: int, virtual_tokens=None
) -> Scheduler:
    """The scheduler `config.scheduler` names; `virtual_tokens(slot)` gives the positions a
    prompt-learning adapter adds (prompt, P- and prefix tuning)."""
    from symbiont.serve.config import SchedulerPolicy

    if config.scheduler is SchedulerPolicy.MLQ:
        from symbiont.serve.mlq import MLQScheduler

        return MLQScheduler(config, kv_cache, max_model_len, virtual_tokens=virtual_tokens)
    return Scheduler(config, kv_cache, max_model_len, virtual_tokens=virtual_tokens)


def _sampled_logprobs(
    logits: torch.Tensor, sampling: list[Sequence], tokens: list[int]
) -> list[TokenLogprob | None]:
    """The log-probability of each sampled token whose request asked for it (else None).
    logits [n_samples, vocab], raw."""
    rows = [i for i, seq in enumerate(sampling) if seq.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(sampling)
    if rows:
        picked = logits[torch.tensor(rows, device=logits.device)]
        top_n = [sampling[i].params.logprobs for i in rows]
        for i, scored in zip(
            rows, token_logprobs(picked, [tokens[i] for i in rows], top_n), strict=True
        ):
            out[i] = scored
    return out
