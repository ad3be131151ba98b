"""``"package.module:function"`` references in the config (``[task].factory``, ``[rl].loss``)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

_SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def resolve_callable(spec: str, key: str) -> Callable[..., Any]:
    """Imports ``module`` and returns its attribute ``function`` (dots walk nested attributes).

    Args:
      spec: ``"package.module:function"``.
      key: the config key that holds it (``"[task].factory"``), for messages.

    Raises:
      ValueError: ``config <key> = '<spec>': <what failed>`` — a malformed reference, a module
        that cannot be imported (with the import error), a missing or non-callable attribute.
    """
    where = f"config {key} = {spec!r}"
    if not isinstance(spec, str) or not _SPEC_RE.match(spec):
        raise ValueError(f"{where}: expected 'package.module:function'")
    module_name, attr = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}: cannot import module {module_name!r} ({exc})") from None
    except Exception as exc:  # the module's own code failed at import time
        raise ValueError(
            f"{where}: importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{where}: {attr!r} is not callable ({type(obj).__name__})")
    return obj


def call_factory(fn: Callable[..., Any], spec: str, key: str, **kwargs: Any) -> Any:
    """Calls a resolved factory; its failure becomes one ``ValueError`` naming the reference."""
    try:
        return fn(**kwargs)
    except Exception as exc:  # a user's factory: any failure is a configuration error
        raise ValueError(
            f"config {key} = {spec!r}: calling it with {sorted(kwargs)} raised "
            f"{type(exc).__name__}: {exc}"
        ) from None
