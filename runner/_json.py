"""Strict parsing of user JSON: one JSONL line or one request body.

Rules (one place, imported by the SFT data reader, the QA task's file and the server's body
parser): a UTF-8 byte-order mark at the start of a file is accepted (editors on Windows write
one); a key that appears twice in one object is refused, naming it (``json.loads`` would keep
the last value silently); a value nested deeper than `MAX_DEPTH` is refused with one error
rather than a ``RecursionError`` traceback.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["BOM", "MAX_DEPTH", "JsonError", "loads"]

BOM = b"\xef\xbb\xbf"
#: Deepest nesting of arrays/objects accepted (far beyond any record; Python's parser recurses).
MAX_DEPTH = 512


class JsonError(ValueError):
    """Not strict JSON (the message says why, without the location the caller adds)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JsonError(f"duplicate key {key!r} in one object")
        out[key] = value
    return out


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than ``limit`` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, list | dict))
    return False


def loads(raw: bytes, *, first: bool = False) -> Any:
    """Parses ``raw`` (UTF-8) strictly.

    Args:
      raw: the bytes of one JSON value.
      first: the start of a file (a leading byte-order mark is skipped).

    Raises:
      JsonError: not UTF-8, not JSON, a duplicate key, or nested deeper than `MAX_DEPTH`.
    """
    if first and raw.startswith(BOM):
        raw = raw[len(BOM) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"not valid UTF-8 ({exc.reason})") from None
    deep = JsonError(f"a value is nested more than {MAX_DEPTH} levels deep")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise JsonError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # deeper than the parser's own recursion limit
        raise deep from None
    if isinstance(value, list | dict) and _depth_exceeds(value, MAX_DEPTH):
        raise deep  # later code (validation, copies) may recurse over it
    return value
