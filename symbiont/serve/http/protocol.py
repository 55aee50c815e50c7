"""OpenAI-compatible request and response schemas (the subset the server implements)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from symbiont.decoding import MAX_LOGPROBS

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 1000  # characters per stop string
MAX_STOP_TOKENS = 256  # stop token ids per request

# Strict: "5" for an integer, true for 1 or "yes" for true are refused naming the field, as
# OpenAI's API refuses them, not read as something the client may not have meant; NaN and
# infinities are refused as "not a finite number".
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


# OpenAI fields this server does not implement, and the values that ask for nothing:
# any other value is refused (400) rather than silently ignored. Other unknown fields are
# accepted and ignored (`user`, `metadata`, ...).
UNSUPPORTED = {
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    # vLLM's extensions
    "min_tokens": (None, 0),
    "min_p": (None, 0, 0.0),
    "include_stop_str_in_output": (None, False),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


class _Request(BaseModel):
    # extra fields: checked by `_nothing_unsupported`, then unused
    model_config = ConfigDict(extra="allow", **STRICT)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = 0  # vLLM extension: sample among the k likeliest tokens; 0 or -1 = all
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension, handy for benchmarks
    # vLLM extension: generation also stops at any of these tokens (left out of the text,
    # as an end-of-sequence token is)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKENS)

    @model_validator(mode="after")
    def _nothing_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ValueError(
                    f"{name} is not implemented by this server; leave it out (see docs/serving.md)"
                )
        return self

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, stop):
        """Every stop string is searched for after every token of every choice: 100k of
        them held the engine for everyone (OpenAI takes at most 4)."""
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {longest} characters; at most {MAX_STOP_CHARS}")
        return stop

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0 only with echo: score the prompt
    echo: bool = False  # the prompt comes back before the completion (text and logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top-N per token
    return_tokens_as_token_ids: bool = False  # vLLM extension: tokens as "token_id:<id>"


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False  # the log-probability of each generated token
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs
    return_tokens_as_token_ids: bool = False

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: `prompt` (text) or `messages` (through the chat template)."""

    model_config = ConfigDict(extra="ignore", **STRICT)

    model: str | None = None  # any served name (they share one tokenizer); default the base
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)

    model: str | None = None
    tokens: list[int]


class AdapterLoad(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._:/-]+$")
    path: str = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt: int, completion: int) -> dict:
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    ).model_dump()


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
