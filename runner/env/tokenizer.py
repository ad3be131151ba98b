"""A character-level tokenizer with a fixed vocabulary, small enough for a tiny local model.

Ids ``0..2`` are the special tokens ``PAD`` (0), ``BOS`` (1) and ``EOS`` (2); every other id is one
character of `CHARS`. The vocabulary is fixed in code, so a checkpoint and its tokenizer can never
disagree.

Example:
  >>> from runner.env import tokenizer as tok
  >>> ids = tok.encode("calc 4*2\\n")
  >>> tok.decode(ids)
  'calc 4*2\\n'
  >>> tok.VOCAB_SIZE
  53
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: Special tokens, in id order. Decoded as their names (``"<pad>"`` ...).
SPECIALS = ("<pad>", "<bos>", "<eos>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: Ordinary characters, in id order starting at ``len(SPECIALS)``: digits, the calculator's
#: operators, punctuation, space, newline, lowercase letters, and the prompt's capitals.
CHARS = "0123456789+-*=:,.?() \nabcdefghijklmnopqrstuvwxyzQA"
VOCAB_SIZE = len(SPECIALS) + len(CHARS)

_CHAR_TO_ID = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
_ID_TO_STR = list(SPECIALS) + list(CHARS)
NEWLINE_ID = _CHAR_TO_ID["\n"]

assert len(set(CHARS)) == len(CHARS), "duplicate characters in the vocabulary"
assert VOCAB_SIZE <= 64


def encode(text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of ``text``, one per character.

    Args:
      text: a string over `CHARS`.
      add_bos: prepend ``BOS_ID``.
      add_eos: append ``EOS_ID``.

    Returns:
      list of int ids in ``[0, VOCAB_SIZE)``.

    Raises:
      ValueError: naming the first character outside the vocabulary and its position.
    """
    if not isinstance(text, str):
        raise ValueError(f"encode expects a str, got {type(text).__name__}")
    ids = [BOS_ID] if add_bos else []
    for pos, ch in enumerate(text):
        i = _CHAR_TO_ID.get(ch)
        if i is None:
            raise ValueError(
                f"cannot encode character {ch!r} at position {pos}: it is not in the vocabulary"
            )
        ids.append(i)
    if add_eos:
        ids.append(EOS_ID)
    return ids


def decode(ids: Iterable[int], *, skip_special: bool = False) -> str:
    """The text of ``ids``: one character per id; special tokens as ``"<pad>"`` etc.

    Args:
      ids: token ids (ints or an integer array).
      skip_special: drop special tokens instead of rendering their names.

    Returns:
      str. For any text ``s`` over `CHARS`, ``decode(encode(s)) == s``.

    Raises:
      ValueError: naming the first id outside ``[0, VOCAB_SIZE)`` and its position.
    """
    arr = np.asarray(ids if hasattr(ids, "shape") else list(ids))
    if arr.size and (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(
            f"decode expects a flat sequence of integer token ids, got shape {arr.shape} and "
            f"dtype {arr.dtype}"
        )
    out = []
    for pos, raw in enumerate(arr.tolist()):
        i = int(raw)
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(
                f"cannot decode token id {i} at position {pos}: outside the vocabulary "
                f"[0, {VOCAB_SIZE})"
            )
        if skip_special and i < len(SPECIALS):
            continue
        out.append(_ID_TO_STR[i])
    return "".join(out)
