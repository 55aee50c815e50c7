"""Decoding, one way for everyone: `SamplingParams`, the sampler, the stop rule.

`symbiont generate` (and the demo's generating client, which runs it) and the serving
engine (`symbiont serve`) both decode with what this module defines:

- `SamplingParams`: one frozen, validated set of decoding parameters (OpenAI/vLLM names).
- `sample`: the next token of each row of a batch of logits (greedy, temperature, top-k,
  top-p), NaN-safe, with one `torch.Generator` per sequence for seeded reproducibility.
- `token_finish` and `TextTracker`: when a sequence ends (end-of-sequence or stop token,
  token limit, stop string) and which of its text is final (`held_back`).
- `token_logprobs`: log-probabilities of given tokens with their likeliest alternatives
  (`TokenLogprob`), from the raw logits (before temperature, top-k, top-p, as vLLM's
  default); the serve engine returns them for `logprobs` and `prompt_logprobs`.

`generate` runs one prompt through Hugging Face `model.generate` (so every PEFT method and
KV-cache placement works), with the sampler above as its only logits rule and the stop
rule above as its only stopping rule.

Sampler rules, in order (as vLLM applies them):
1. temperature 0 is greedy: the argmax of the logits (NaN logits count as -inf).
2. otherwise logits / temperature; top_k > 0 keeps the k largest logits (ties at the k-th
   value are kept); softmax; top_p < 1 keeps the smallest set of likeliest tokens whose
   probability mass reaches top_p (the likeliest token is always kept); one draw.
3. a row whose probabilities are not finite (NaN or inf logits, overflow) falls back to
   its greedy token; other rows are unaffected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, so SamplingParams (CLI flags) loads fast
    import torch

KV_OFFLOAD = ("none", "cpu")
MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20  # most alternatives per position a request may ask for (vLLM's default)


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _help(text: str, **kw) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request decodes. Defaults follow the OpenAI API (temperature 1.0)."""

    max_tokens: int = field(default=16, **_help("most tokens to generate (>= 1)"))
    temperature: float = field(
        default=1.0, **_help("sampling temperature (>= 0); 0 decodes greedily (argmax)")
    )
    top_p: float = field(
        default=1.0,
        **_help("nucleus sampling: keep the likeliest tokens whose mass reaches this (0, 1]"),
    )
    top_k: int = field(
        default=0, **_help("sample among the k likeliest tokens; 0 (or -1) = all tokens")
    )
    seed: int | None = field(
        default=None, **_help(f"seed for reproducible sampling, in [0, {MAX_SEED}]")
    )
    n: int = field(default=1, **_help("number of continuations of the prompt (>= 1)"))
    stop: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "stop when this text is generated (not output); repeat for several",
            "metavar": "TEXT",
        },
    )
    stop_token_ids: tuple[int, ...] = field(
        default=(), **_help("token ids that end a sequence, besides end-of-sequence")
    )
    ignore_eos: bool = field(default=False, **_help("keep generating past end-of-sequence tokens"))
    # Serving only (no help text, so no CLI flag): log-probabilities of each generated
    # token (`logprobs`) and of each prompt token but the first (`prompt_logprobs`), each
    # with its N likeliest alternatives; None returns none. They are the log-softmax of
    # the model's raw logits, before temperature, top-k and top-p (vLLM's default).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # max_tokens 0 scores the prompt and generates nothing (needs prompt_logprobs)
        _check_int("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        _check_float("temperature", self.temperature, 0.0, math.inf, "a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, -1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        _check_int("n", self.n, 1)
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stops, tuple | list) or not all(isinstance(s, str) for s in stops):
            raise InvalidSamplingParams("stop", f"must be a tuple of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(s for s in stops if s))  # "" never stops
        if not isinstance(self.stop_token_ids, tuple | list):
            raise InvalidSamplingParams("stop_token_ids", "must be a tuple of token ids")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParams(
                "ignore_eos", f"must be true or false, not {self.ignore_eos!r}"
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def help(cls) -> dict[str, str]:
        """field name -> help text (for generated CLI flags and docs); serving-only
        fields have none."""
        return {f.name: f.metadata["help"] for f in fields(cls) if "help" in f.metadata}


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSamplingParams(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        shown = str(value) if len(str(value)) <= 24 else f"a number of {len(str(value))} digits"
        raise InvalidSamplingParams(name, f"must be {allowed}, got {shown}")


def _check_float(name: str, value, low: float, high: float, allowed: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise InvalidSamplingParams(name, f"must be {allowed} (finite), got {value!r}")


# -- the sampler --------------------------------------------------------------------------


def make_generator(params: SamplingParams, index: int = 0) -> torch.Generator | None:
    """The random stream of choice `index` of a request: seeded from `seed + index` when a
    seed is given, else from the OS; None for greedy decoding. Never the global RNG."""
    import torch

    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed((params.seed + index) % (MAX_SEED + 1))
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """logits [n_rows, vocab] (one row per sequence) -> one token id per row (rules in the
    module docstring). One device sync, at the end."""
    import torch

    logits = logits.float().nan_to_num(nan=-math.inf)  # [n_rows, vocab]
    tokens = logits.argmax(dim=-1)  # [n_rows]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = _probabilities(logits[index], [params[i] for i in rows])  # [n_sampled, vocab]
        noise = torch.stack([_exponential(logits.shape[1], generators[i]) for i in rows])
        drawn = (probs / noise.to(logits.device)).argmax(dim=-1)  # exponential race = one draw
        valid = probs.isfinite().all(dim=-1) & (probs.sum(dim=-1) > 0)
        tokens[index] = torch.where(valid, drawn, tokens[index])
    return tokens.tolist()


def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] logits -> [rows, vocab] probabilities after temperature, top-k, top-p."""
    import torch

    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperature[:, None]
    top_k = [p.top_k for p in params]
    if any(top_k):
        logits = _top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    top_p = [p.top_p for p in params]
    if any(p < 1 for p in top_p):
        probs = _top_p(probs, torch.tensor(top_p, dtype=torch.float64, device=logits.device))
    return probs


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: all); the rest become -inf."""
    import torch

    vocab = logits.shape[1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [rows, 1]
    return logits.masked_fill(logits < kth, -math.inf)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row);
    the likeliest token always stays. probs [rows, vocab], top_p [rows] -> probs."""
    import torch

    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = (sorted_probs.cumsum(dim=-1) - sorted_probs).double()
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def _exponential(vocab: int, generator: torch.Generator | None) -> torch.Tensor:
    """[vocab] Exp(1) noise from the sequence's own generator (CPU; moved once)."""
    import torch

    device = generator.device if generator is not None else "cpu"
    noise = torch.empty(vocab, device=device).exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # never 0: 0/0 would be NaN


# -- log-probabilities --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one token at one position, with the likeliest alternatives."""

    token_id: int
    logprob: float  # log-softmax of the raw logits (-inf when the model rules it out)
    rank: int  # 1 = the likeliest token at this position
    top: tuple[tuple[int, float], ...]  # the N likeliest (token id, logprob), likeliest first


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top_n: Sequence[int]
) -> list[TokenLogprob]:
    """logits [rows, vocab] (raw, one row per position), the token that follows each row
    and how many alternatives each row wants -> one `TokenLogprob` per row. Computed in
    fp32 from the raw logits (NaN counts as -inf); one device sync."""
    import torch

    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float().nan_to_num(nan=-math.inf), dim=-1)  # [rows, vocab]
    index = torch.tensor(list(token_ids), device=logits.device)[:, None]  # [rows, 1]
    chosen = logp.gather(1, index)  # [rows, 1]
    rank = (logp > chosen).sum(dim=-1) + 1  # [rows]
    k = min(max(top_n), logp.shape[1])
    top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], index[:, :0])
    chosen_l, rank_l = chosen[:, 0].tolist(), rank.tolist()
    values_l, ids_l = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(
            token_ids[i],
            chosen_l[i],
            rank_l[i],
            tuple(zip(ids_l[i][: top_n[i]], values_l[i][: top_n[i]], strict=True)),
        )
        for i in range(len(token_ids))
    ]


# -- the stop rule ------------------------------------------------------------------------


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token, a stop token, or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled or client disconnected
    ERROR = "error"  # failed; the request's error says why


def eos_token_ids(model, tokenizer=None) -> frozenset[int]:
    """End-of-sequence ids, as Hugging Face generate sees them: the model's generation
    config, else its config, else the tokenizer's eos token."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset(eos) if isinstance(eos, list | tuple) else frozenset({int(eos)})
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({eos})


def stop_ids(params: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """Token ids that end a sequence under `params`."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)


def token_finish(
    token: int, n_generated: int, params: SamplingParams, ends: frozenset[int]
) -> FinishReason | None:
    """Why a sequence ends after generating `token` (its `n_generated`-th), or None.
    `ends` is `stop_ids(params, eos_ids)`. The context limit is the caller's."""
    if token in ends:
        return FinishReason.STOP
    if n_generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` not yet final: an incomplete UTF-8 sequence at the
    end (decoded as U+FFFD), and before it a proper prefix of some stop string (the
    incomplete character may complete one: with stop "aé", "xa" + half an "é" holds the
    "a" back too)."""
    complete = text.rstrip("\ufffd")
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(complete)), longest, -1):
            if complete.endswith(stop[:n]):
                longest = n
                break
    return len(text) - len(complete) + longest


def first_stop(text: str, stops: tuple[str, ...], final: bool = False) -> int | None:
    """Index of the earliest stop string in `text`, or None. Unless `final`, a trailing
    U+FFFD is an incomplete character, not text a stop string can match yet."""
    if not final:
        text = text.rstrip("\ufffd")
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


class TextTracker:
    """The text of one sequence as its tokens arrive: cut at the first stop string, and
    released only once final (`held_back`). `update` returns the newly final text."""

    ANCHOR_EVERY = 8  # tokens decoded past the anchor before it moves up

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""  # decoded output, stop string and what follows removed
        self.released = ""  # text already handed out (a prefix of `text`)
        self.stopped = False  # a stop string was found
        # Decoding the whole output at every token costs O(n) per token. Where decoding is
        # concatenative at a complete character (`_decodes_by_bytes`), the text of a prefix
        # (the anchor) is kept and only the tokens after it are decoded.
        self._by_bytes = _decodes_by_bytes(tokenizer)
        self._anchor_ids: list[int] = []  # a prefix of the output whose text ends cleanly
        self._anchor_text = ""  # == decode(_anchor_ids)

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """Decode the output tokens (without a token that ended the sequence) and return the
        text that became final; `final` releases everything held back."""
        if self.stopped:
            return ""
        text = self._decode(token_ids)
        cut = first_stop(text, self.stop, final)
        if cut is not None:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        safe = text if final else text[: len(text) - held_back(text, self.stop)]
        if len(safe) <= len(self.released) or not safe.startswith(self.released):
            return ""
        new, self.released = safe[len(self.released) :], safe
        return new

    def _decode(self, token_ids: list[int]) -> str:
        """`tokenizer.decode(token_ids, skip_special_tokens=True)`, from the anchor on when
        `token_ids` extends it."""
        if not self._by_bytes:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        n = len(self._anchor_ids)
        if len(token_ids) < n or token_ids[:n] != self._anchor_ids:
            n, self._anchor_ids, self._anchor_text = 0, [], ""
        text = self._anchor_text + self.tokenizer.decode(token_ids[n:], skip_special_tokens=True)
        # A text not ending in U+FFFD ends on a complete UTF-8 character, so the next
        # tokens' bytes cannot merge with it: decode(a + b) == decode(a) + decode(b).
        if len(token_ids) - n >= self.ANCHOR_EVERY and not text.endswith("\ufffd"):
            self._anchor_ids, self._anchor_text = list(token_ids), text
        return text


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of one token of a byte-level BPE tokenizer (GPT-2's byte-to-character
    map undone): for a token holding part of a character, decoding it alone gives U+FFFD,
    its bytes are what joins with its neighbours'. None for other tokenizers."""
    if not _decodes_by_bytes(tokenizer):
        return None
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or any(c not in _BYTE_OF_CHAR for c in piece):
        return None  # an added or special token: not byte-mapped
    return bytes(_BYTE_OF_CHAR[c] for c in piece)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's map from the 256 printable stand-ins back to the bytes they stand for."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()


def _decodes_by_bytes(tokenizer) -> bool:
    """Whether `tokenizer.decode` maps each token to bytes and decodes their concatenation
    as UTF-8 (a Hugging Face fast tokenizer whose decoder is ByteLevel, with no clean-up of
    spaces): then decoding splits at any complete character."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return (
        type(decoder).__name__ == "ByteLevel"
        and type(decoder).__module__.startswith("tokenizers")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


# -- one prompt through Hugging Face generate ---------------------------------------------


@dataclass(frozen=True)
class GenerationResult:
    text: str  # generated text, stop string excluded
    token_ids: tuple[int, ...]  # generated tokens (may run past the stop string's end)
    stop_reason: str  # "stop" (a stop string or stop token), "eos", or "length"
    prompt_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class _Decoder:
    """The sampler and the stop rule inside `model.generate` (batch of one).

    As a logits processor it picks the next token with `sample` and leaves only that
    token finite, so generate's greedy step takes it; as a stopping criterion it applies
    `token_finish` and the stop strings, and streams final text to `on_text`."""

    def __init__(self, params, tokenizer, ends, prompt_len, on_text):
        self.params, self.ends, self.prompt_len = params, ends, prompt_len
        self.generator = make_generator(params)
        self.tracker = TextTracker(tokenizer, params.stop)
        self.on_text = on_text
        self.finish: FinishReason | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Logits processor: scores [1, vocab] -> [1, vocab] with one finite entry."""
        import torch

        token = sample(scores, [self.params], [self.generator])[0]
        chosen = torch.full_like(scores, -math.inf)
        chosen[:, token] = 0.0
        return chosen

    def should_stop(self, input_ids: torch.Tensor) -> bool:
        """Stopping criterion after each new token; input_ids [1, prompt + generated]."""
        output = input_ids[0, self.prompt_len :].tolist()
        self.finish = token_finish(output[-1], len(output), self.params, self.ends)
        text_ids = output[:-1] if self.finish is FinishReason.STOP else output
        self._emit(self.tracker.update(text_ids, final=self.finish is not None))
        if self.tracker.stopped:
            self.finish = FinishReason.STOP
        return self.finish is not None

    def _emit(self, text: str) -> None:
        if text and self.on_text is not None:
            self.on_text(text)


def make_cache(model, kv_offload: str):
    """The KV cache for one generation.

    "cpu": keep the cache in host memory. On an accelerator this is Transformers'
    offloaded cache (each layer's keys and values live in host memory and are prefetched
    just before that layer runs); a client that already runs on the CPU keeps its cache
    in host memory anyway, so it gets the plain cache.
    """
    from transformers import DynamicCache

    if kv_offload not in KV_OFFLOAD:
        raise ValueError(f"kv_offload must be one of {KV_OFFLOAD}, got {kv_offload!r}")
    offload = kv_offload == "cpu" and model.device.type != "cpu"
    return DynamicCache(config=model.config, offloading=offload)


def generate(
    model,
    tokenizer,
    prompt: str | list[int],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
    kv_offload: str = "none",
) -> GenerationResult:
    """Generate one continuation of `prompt` (text, or token ids), streaming final text to
    `on_text`; `kv_offload="cpu"` keeps the KV cache in host memory."""
    import torch
    from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    if params.n != 1:
        raise InvalidSamplingParams("n", "generate makes one continuation; use n=1")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise InvalidSamplingParams(
            "logprobs", "generate does not return log-probabilities; the serve engine does"
        )
    cache = make_cache(model, kv_offload)
    ids = _prompt_ids(tokenizer, prompt, model.device)  # [1, prompt_len]
    eos = eos_token_ids(model, tokenizer)
    decoder = _Decoder(params, tokenizer, stop_ids(params, eos), ids.shape[1], on_text)

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            stop = decoder.should_stop(input_ids)
            return torch.full((input_ids.shape[0],), stop, device=input_ids.device)

    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=params.max_tokens,
            logits_processor=LogitsProcessorList([decoder]),
            stopping_criteria=StoppingCriteriaList([_Stop()]),
            past_key_values=cache,
            pad_token_id=_pad_id(tokenizer),
            eos_token_id=sorted(decoder.ends) or None,
            do_sample=False,  # the choice is made by `sample` above
            temperature=None,
            top_p=None,
            top_k=None,
        )  # [1, prompt_len + generated]
    seconds = time.perf_counter() - started
    new_ids = tuple(out[0, ids.shape[1] :].tolist())
    if decoder.finish is None:  # generate ended on its own length limit
        decoder._emit(decoder.tracker.update(list(new_ids), final=True))
    return GenerationResult(
        text=decoder.tracker.released,
        token_ids=new_ids,
        stop_reason=_stop_reason(decoder, new_ids, eos),
        prompt_tokens=ids.shape[1],
        seconds=seconds,
    )


def chat_prompt(tokenizer, user_message: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat ending in the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template; this model has none")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_message}
    ]
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(out)


def _prompt_ids(tokenizer, prompt, device) -> torch.Tensor:
    import torch

    ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    return torch.tensor([ids], dtype=torch.long, device=device)


def _pad_id(tokenizer) -> int | None:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _stop_reason(decoder: _Decoder, new_ids, eos: frozenset[int]) -> str:
    if decoder.finish is FinishReason.STOP:
        return "eos" if not decoder.tracker.stopped and new_ids[-1] in eos else "stop"
    return "length"
