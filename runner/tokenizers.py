"""Tokenizers: the protocol the runner needs, the built-in character tokenizer, and Hugging Face
``tokenizer.json`` files loaded offline.

A `Tokenizer` maps text to ids and back, and declares its vocabulary size and special ids. Two
implementations:

* `CharTokenizer` — the built-in 53-symbol character tokenizer (`runner.env.tokenizer`), the
  default (``[tokenizer] path = ""``). It has no chat template: records render as the
  concatenation of their contents (`runner.chat.ConcatRenderer`).
* `HFTokenizer` — a Hugging Face fast tokenizer read with the ``tokenizers`` library from a
  ``tokenizer.json`` file or a model directory that holds one. Nothing is ever downloaded. Its
  special tokens (``bos_token``, ``eos_token``, ``pad_token``) and chat template come from the
  directory's ``tokenizer_config.json`` (or ``chat_template.jinja``) when present; the template is
  rendered with jinja2 (`runner.chat.TemplateRenderer`).

`load_tokenizer` builds the configured one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from runner.env import tokenizer as _chars

#: ``[tokenizer] chat_template`` value that turns a model directory's template off.
NO_TEMPLATE = "none"


@runtime_checkable
class Tokenizer(Protocol):
    """What the runner needs from a tokenizer.

    Attributes:
      name: a short description for messages (``"chars"``, a path).
      vocab_size: ids are in ``[0, vocab_size)``; the local model's embedding size.
      bos_id, eos_id: the begin/end-of-sequence ids, or ``None`` when the tokenizer has none.
      bos_token, eos_token: their strings (chat-template variables), or ``None``.
      pad_id: the id used to pad batches (never read as data: masks say what is real).
      stop_token_ids: the ids that end a policy turn by default (`runner.tasks.qa` uses them).
      chat_template: jinja source of the chat template, or ``None`` (concatenation).
    """

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    bos_token: str | None
    eos_token: str | None
    pad_id: int
    stop_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added (``ValueError`` if it cannot)."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """``(ids, starts)``: the ids of ``text`` and each token's first character index."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens rendered as their strings)."""
        ...


class CharTokenizer:
    """The built-in character tokenizer (`runner.env.tokenizer`) behind the `Tokenizer` protocol.

    ``stop_token_ids`` are newline and EOS: the calculator's turns end at a newline.
    """

    name = "chars"
    vocab_size = _chars.VOCAB_SIZE
    bos_id: int | None = _chars.BOS_ID
    eos_id: int | None = _chars.EOS_ID
    bos_token: str | None = _chars.SPECIALS[_chars.BOS_ID]
    eos_token: str | None = _chars.SPECIALS[_chars.EOS_ID]
    pad_id = _chars.PAD_ID
    stop_token_ids = (_chars.NEWLINE_ID, _chars.EOS_ID)
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return _chars.encode(text)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        return _chars.encode(text), list(range(len(text)))

    def decode(self, ids: Sequence[int]) -> str:
        return _chars.decode(ids)

    def __repr__(self) -> str:
        return "CharTokenizer()"


def _token_text(value: Any) -> str | None:
    """A ``tokenizer_config.json`` special-token entry: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizers.Tokenizer``), loaded offline.

    Args:
      path: a ``tokenizer.json`` file, or a directory holding ``tokenizer.json`` and optionally
        ``tokenizer_config.json`` / ``chat_template.jinja``.
      chat_template: a ``.jinja`` file overriding the directory's template; `NO_TEMPLATE` turns
        it off; ``""``: the directory's (``chat_template.jinja``, else ``tokenizer_config.json``).

    Raises:
      ValueError: naming the file and what is wrong with it.
    """

    def __init__(self, path: str | Path, *, chat_template: str = ""):
        from tokenizers import Tokenizer as _HF

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"[tokenizer].path: no tokenizer.json at {p}")
        try:
            self._tok = _HF.from_file(str(file))
        except Exception as exc:  # the library's own parse errors (a bad or foreign file)
            raise ValueError(f"[tokenizer].path: cannot read {file}: {exc}") from None
        self.name = str(file)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config: dict[str, Any] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"[tokenizer]: {cfg_file} is not valid JSON: {exc}") from None
            if not isinstance(config, dict):
                raise ValueError(f"[tokenizer]: {cfg_file} must hold a JSON object")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_id = self._special_id(self.bos_token, "bos_token", cfg_file)
        self.eos_id = self._special_id(self.eos_token, "eos_token", cfg_file)
        pad = self._special_id(_token_text(config.get("pad_token")), "pad_token", cfg_file)
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.stop_token_ids = (self.eos_id,) if self.eos_id is not None else ()
        self.chat_template = self._template(chat_template, file.parent, config, cfg_file)

    def _special_id(self, text: str | None, key: str, where: Path) -> int | None:
        if text is None:
            return None
        i = self._tok.token_to_id(text)
        if i is None:
            raise ValueError(f"[tokenizer]: {where} {key} {text!r} is not in the vocabulary")
        return int(i)

    @staticmethod
    def _template(option: str, folder: Path, config: dict[str, Any], where: Path) -> str | None:
        if option == NO_TEMPLATE:
            return None
        if option:
            f = Path(option)
            if not f.is_file():
                raise ValueError(f"[tokenizer].chat_template: file not found: {f}")
            return f.read_text()
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        raw = config.get("chat_template")
        if raw is None:
            return None
        if isinstance(raw, list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            raw = named.get("default")
        if not isinstance(raw, str) or not raw:
            raise ValueError(
                f"[tokenizer]: {where} chat_template must be a string (or a list holding a "
                "'default' template)"
            )
        return raw

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [int(start) for start, _ in enc.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(np.argmax((arr < 0) | (arr >= self.vocab_size)))
            raise ValueError(
                f"cannot decode token id {int(arr[bad])} at position {bad}: outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        return self._tok.decode(arr.tolist(), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(path: str = "", chat_template: str = "") -> Tokenizer:
    """The configured tokenizer: `CharTokenizer` for ``path = ""``, else `HFTokenizer`.

    Raises:
      ValueError: a chat template given for the character tokenizer, or an unreadable file.
    """
    if not path:
        if chat_template and chat_template != NO_TEMPLATE:
            raise ValueError(
                "[tokenizer].chat_template needs a Hugging Face tokenizer ([tokenizer].path); "
                "the built-in character tokenizer renders records as concatenations"
            )
        return CharTokenizer()
    return HFTokenizer(path, chat_template=chat_template)
