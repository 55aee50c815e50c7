"""Streaming text generation on a client model: greedy or sampled, stop strings, token
limits, and an option to keep the KV cache in host memory (Symbiosis 3.4).

`model.generate()` does the decoding; this module adds what a person driving it needs:
text delivered as it is produced (held back only while it might be the start of a stop
string), stop strings that end generation and are cut from the output, seeded sampling
that does not disturb the caller's RNG, and the choice of KV-cache placement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

KV_OFFLOAD = ("none", "cpu")


@dataclass(frozen=True)
class GenerationSettings:
    """How to decode. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    kv_offload: str = "none"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.kv_offload not in KV_OFFLOAD:
            raise ValueError(f"kv_offload must be one of {KV_OFFLOAD}, got {self.kv_offload!r}")

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def generate_kwargs(self) -> dict:
        """Decoding arguments for `model.generate` (all set, so the model's
        generation_config defaults such as top_k=50 never apply silently)."""
        if not self.sampling:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }


@dataclass(frozen=True)
class GenerationResult:
    text: str  # generated text, stop string excluded
    token_ids: tuple[int, ...]  # generated tokens (may run past the stop string's end)
    stop_reason: str  # "stop" (a stop string), "eos", or "length"
    prompt_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class TextStream(BaseStreamer):
    """Incrementally decodes generated tokens and hands out text that is final.

    Text is held back while it ends in an incomplete character or could be the start of
    a stop string; once a stop string appears, the text before it is released and
    `stopped` is set, which `StopWhenStreamStops` turns into the end of generation.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self.tokenizer, self.stop, self.on_text = tokenizer, stop, on_text
        self.token_ids: list[int] = []
        self.released = ""  # text already handed out
        self.stopped = False
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        """generate() calls this with the prompt first, then with each new token [1] or [1, 1]."""
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.stopped:
            return
        self.token_ids.extend(value.reshape(-1).tolist())
        self._release(self._decoded(), final=False)

    def end(self) -> None:
        if not self.stopped:
            self._release(self._decoded(), final=True)

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _release(self, text: str, *, final: bool) -> None:
        cut = _first_stop(text, self.stop)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            text = text[: len(text) - held_back(text, self.stop)]
        if len(text) > len(self.released) and text.startswith(self.released):
            new = text[len(self.released) :]
            self.released = text
            if self.on_text is not None:
                self.on_text(new)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` not yet final: an incomplete UTF-8 sequence
    (decoded as U+FFFD) or a proper prefix of some stop string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class StopWhenStreamStops(StoppingCriteria):
    def __init__(self, stream: TextStream):
        self.stream = stream

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        # [batch] bool: generation here is one sequence at a time
        return torch.full((input_ids.shape[0],), self.stream.stopped, device=input_ids.device)


def make_cache(model, kv_offload: str) -> DynamicCache:
    """The KV cache for one generation.

    "cpu": keep the cache in host memory. On an accelerator this is Transformers'
    offloaded cache (each layer's keys and values live in host memory and are prefetched
    just before that layer runs); a client that already runs on the CPU keeps its cache
    in host memory anyway, so it gets the plain cache.
    """
    offload = kv_offload == "cpu" and model.device.type != "cpu"
    return DynamicCache(config=model.config, offloading=offload)


def generate(
    model,
    tokenizer,
    prompt: str | list[int],
    settings: GenerationSettings,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate a continuation of `prompt` (text, or token ids), streaming text to `on_text`."""
    ids = _prompt_ids(tokenizer, prompt, model.device)  # [1, prompt_len]
    stream = TextStream(tokenizer, settings.stop, on_text)
    started = time.perf_counter()
    with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(model)):
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=settings.max_new_tokens,
            streamer=stream,
            stopping_criteria=StoppingCriteriaList([StopWhenStreamStops(stream)]),
            past_key_values=make_cache(model, settings.kv_offload),
            pad_token_id=_pad_id(tokenizer),
            **settings.generate_kwargs(),
        )  # [1, prompt_len + generated]
    seconds = time.perf_counter() - started
    new_ids = tuple(out[0, ids.shape[1] :].tolist())
    return GenerationResult(
        text=stream.released,
        token_ids=new_ids,
        stop_reason=_stop_reason(stream, new_ids, settings, _eos_ids(model, tokenizer)),
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
    ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    return torch.tensor([ids], dtype=torch.long, device=device)


def _rng_devices(model) -> list:
    return [model.device] if model.device.type == "cuda" else []


def _pad_id(tokenizer) -> int | None:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [eos]
    return {e for e in [*eos, tokenizer.eos_token_id] if e is not None}


def _stop_reason(stream: TextStream, new_ids, settings, eos_ids: set[int]) -> str:
    if stream.stopped:
        return "stop"
    if new_ids and new_ids[-1] in eos_ids:
        return "eos"
    return "length"
