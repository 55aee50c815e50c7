"""Command-line flags generated from frozen config dataclasses, so each default lives once.

A field becomes a flag when its metadata carries help text (`flag(...)` builds it):

    @dataclass(frozen=True)
    class SamplingParams:
        temperature: float = field(
            default=1.0, metadata=flag("sampling temperature; 0 decodes greedily")
        )
        top_k: int = field(default=0, metadata=flag("sample among the k likeliest (0 = off)"))
        stop: tuple[str, ...] = field(
            default=(), metadata=flag("stop at TEXT; repeat for several", metavar="TEXT")
        )
        seed: int | None = None  # no help: not a flag

and a command adds and reads them:

    add_flags(parser, SamplingParams)                 # --temperature, --top-k, --stop
    params = from_args(SamplingParams, args)          # SamplingParams(...) from the flags

Rules, all derived from the field:

- name `--field-name` (override with `name="--other"`); `args.<field name>` holds the value
  already in the field's type and unit, so code never converts twice.
- type from the annotation: int, float, str, `X | None`, a StrEnum (its values become the
  choices), bool (default False: `--flag` sets it; default True: the flag clears it, so name
  it like `--no-shm`), `tuple[str, ...]` (the flag repeats; given values replace the
  default). `type=` parses anything else (e.g. a core list).
- the default is the field's, shown in `--help` as "(default: ...)" in the flag's unit.
- `scale=`: the flag's unit times `scale` is the field's unit (`--max-wait-ms` for
  `max_wait_s`: scale=1e-3); `env=`: a variable read when the flag is absent.
- metadata "aliases": earlier names of a renamed flag, still accepted.
- classes whose source we do not own take the same metadata through
  `add_flags(..., meta={"field": flag("help")})`; their defaults still come from the class.

`from_args` builds the dataclass; a ValueError from its validation becomes `FlagError`,
which `symbiont` reports through argparse (usage line, the message, exit status 2).
Nothing here imports more than the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "MODEL_HELP",
    "FlagError",
    "add_flags",
    "config_actions",
    "flag",
    "from_args",
    "resolve_model",
]

# Every command's --model takes a checkpoint folder or this word (issue: one name for the
# embedded default model everywhere).
DEFAULT_MODEL = "default"
MODEL_HELP = (
    "local Hugging Face checkpoint folder of the base model (with tokenizer), or 'default' "
    "for the embedded default model (built on first use)"
)


def resolve_model(value: str) -> str:
    """`--model` as a folder: 'default' names the embedded default model (built if needed)."""
    if value != DEFAULT_MODEL:
        return value
    from symbiont.model.default import default_model

    return str(default_model())


class FlagError(ValueError):
    """A configuration built from flags is invalid; the message says which flag to fix."""


def flag(
    help: str,
    *,
    name: str | None = None,
    choices: Sequence | None = None,
    metavar: str | None = None,
    scale: float | None = None,
    type: Callable[[str], Any] | None = None,
    env: str | None = None,
) -> dict:
    """Field metadata that makes the field a flag (see the module docstring)."""
    meta = {"help": help, "flag": name, "choices": choices, "metavar": metavar}
    meta.update(scale=scale, type=type, env=env)
    return {k: v for k, v in meta.items() if v is not None}


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    meta: Mapping[str, dict] | None = None,
    required: Sequence[str] = (),
    only: Sequence[str] | None = None,
    defaults: Any = None,
) -> list[argparse.Action]:
    """Add one flag per field of `cls` that has help text (in its metadata or in `meta`).

    `required`: fields that must be given (those without a default are required anyway).
    `only`: just these fields. `defaults`: an instance of `cls` whose values are this
    command's defaults (e.g. `generate` decodes greedily where the API samples), so even a
    command-specific default is a validated config, written once."""
    hints = typing.get_type_hints(cls)
    actions = []
    for field in dataclasses.fields(cls):
        spec = {**field.metadata, **(meta or {}).get(field.name, {})}
        if "help" not in spec or (only is not None and field.name not in only):
            continue
        default = _default(field) if defaults is None else getattr(defaults, field.name)
        action = _add(parser, field, hints[field.name], spec, field.name in required, default)
        action.config_field = (cls, field.name)  # for tests: which default it shows
        action.config_default = default
        actions.append(action)
    return actions


def from_args(cls: type, args: argparse.Namespace, **overrides):
    """`cls(**fields given by flags, **overrides)`; fields without a flag keep their default."""
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in overrides or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if value is not None or _default(field) is None:
            values[field.name] = tuple(value) if isinstance(value, list) else value
    try:
        return cls(**values, **overrides)
    except (ValueError, TypeError) as err:
        raise FlagError(str(err)) from err


def config_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of `parser` generated from a config field (tests compare their defaults)."""
    return [a for a in parser._actions if hasattr(a, "config_field")]


def field_default(cls: type, name: str):
    """The default of field `name` of `cls` (from default or default_factory)."""
    return _default(next(f for f in dataclasses.fields(cls) if f.name == name))


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _metavar(kind, name: str) -> str:
    """N for a count, X for a real number (a rate, a probability), PATH for a file or
    folder, else the flag's name."""
    if kind is int:
        return "N"
    if kind is float:
        return "X"
    if kind is Path or kind == "Path":
        return "PATH"
    return name[2:].upper()


def _add(parser, field, hint, spec: dict, required: bool, default) -> argparse.Action:
    name = spec.get("flag") or "--" + field.name.replace("_", "-")
    names = [name, *spec.get("aliases", ())]  # earlier names of a renamed flag keep working
    required = required or default is dataclasses.MISSING
    kind = _unwrap_optional(hint)
    kwargs: dict[str, Any] = {"dest": field.name, "help": spec["help"]}
    kwargs["metavar"] = spec.get("metavar", _metavar(kind, name))
    shown = None if required else _shown(default, spec)
    if kind is bool:
        del kwargs["metavar"]
        kwargs["action"] = "store_false" if default is True else "store_true"
        kwargs["default"] = bool(default)
        return parser.add_argument(*names, **kwargs)
    if typing.get_origin(kind) is tuple:
        kwargs.update(action="append", default=None, type=_parser_type(str, spec))
        shown = ", ".join(map(str, default)) if default else None
    else:
        kwargs["type"] = _parser_type(kind, spec)
        kwargs["default"] = None if required else default
        choices = spec.get("choices")
        if choices is None and _is_enum(kind):
            choices = [member.value for member in kind]
        if choices is not None:
            kwargs["choices"] = list(choices)
            kwargs["metavar"] = spec.get("metavar", "{" + ",".join(map(str, choices)) + "}")
    if "env" in spec:  # read now, as a default the user sees and a flag overrides
        kwargs["default"] = os.environ.get(spec["env"]) or kwargs["default"]
        shown = f"${spec['env']}" + (f", else {shown}" if shown else "")
    if shown is not None:
        kwargs["help"] += f" (default: {shown})"
    kwargs["required"] = required
    return parser.add_argument(*names, **kwargs)


def _is_enum(kind) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def _unwrap_optional(hint):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _parser_type(kind, spec: dict) -> Callable[[str], Any]:
    if "type" in spec:
        return _argparse_errors(spec["type"])
    if _is_enum(kind):  # parsed as its values, so argparse's choices message applies
        return type(next(iter(kind)).value)
    if kind not in (int, float, str):
        raise TypeError(f"no flag type for {kind!r}: pass flag(..., type=a parser)")
    return _in_field_unit(kind, spec)


def _argparse_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser whose ValueError message reaches the user (argparse hides all but the name)."""

    def wrapped(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


def _in_field_unit(kind, spec: dict) -> Callable[[str], Any]:
    """Parse the flag's text into the field's type and unit."""
    scale = spec.get("scale")
    if scale is None:
        return kind

    def parse(text: str):
        value = float(text) * scale
        return round(value) if kind is int else value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _shown(default, spec: dict) -> str | None:
    """The default as `--help` shows it, in the flag's unit."""
    if default is None or default is dataclasses.MISSING:
        return None
    if isinstance(default, enum.Enum):
        default = default.value
    if "scale" in spec:
        default = default / spec["scale"]
        default = round(default, 9)
        if float(default).is_integer():
            default = int(default)
    return str(default)
