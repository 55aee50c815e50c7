"""Package namespaces whose names load on first use, so that importing a package (for
`symbiont --help`, or for one light submodule) does not import torch and transformers."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package` re-exporting `name -> defining module`."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
