"""SFT data: JSONL records, their validation, rendering, length policy, batching and position.

**Records** (one JSON object per line; blank lines are not records):

* ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}``;
* ``{"prompt": "...", "completion": "..."}`` (read as a user and an assistant message).

Other keys are allowed and ignored. A bad record fails before training with the file, the line,
the field and the rule (``train.jsonl:1734: messages[2].role must be one of assistant, system,
tool, user, got 'bot'``). Records render through the tokenizer's renderer (`runner.chat`); the
loss is on assistant tokens only (``[sft].train_on``).

**Length policy** (``[sft].overflow``, limit ``[model].max_seq_len`` model-input tokens):
``"error"`` (default) stops naming the record; ``"truncate"`` cuts the record from the right
(counted; a record left with no assistant token is an error); ``"drop"`` leaves the record out
(counted). Nothing is skipped silently.

**Batches and position.** The training records are visited epoch after epoch; epoch ``e`` visits
them in the order ``epoch_order(n, seed, e)`` (a permutation drawn from ``(seed, e)``, or file
order without shuffling). A batch is the next ``[sft].batch_size`` records of the epoch, or with
``[sft].batch_tokens > 0`` the next records whose token counts sum to at most that budget (at least
one record); batches never span epochs (an epoch's last batch may be smaller). The position
``(epoch, index)`` after a step is part of the run state (`FileSource.position_state`), so a
resumed run continues with exactly the records the uninterrupted run would have trained on, in the
same order, across epoch boundaries too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runner._json import BOM, JsonError
from runner._json import loads as strict_json
from runner.chat import MessageError, Renderer

ROLES = ("assistant", "system", "tool", "user")
OVERFLOW = ("error", "truncate", "drop")


def parse_record(obj: Any, where: str) -> tuple[list[dict[str, str]], list[str]]:
    """A record's messages, and the field naming each message's content (for errors).

    Args:
      obj: the decoded JSON value.
      where: ``"file:line"`` (or another location) prefixed to every error.

    Returns:
      ``(messages, fields)``: ``[{"role", "content"}, ...]`` and e.g. ``["messages[0].content",
      ...]`` or ``["prompt", "completion"]``.

    Raises:
      ValueError: ``"<where>: <field> <rule>"``.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        if "prompt" in obj or "completion" in obj:
            raise ValueError(f'{where}: a record has "messages" or "prompt"/"completion", not both')
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: messages must be a non-empty list")
        out, fields = [], []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ValueError(
                    f'{where}: messages[{i}] must be an object with "role" and "content", got '
                    f"{type(m).__name__}"
                )
            role = m.get("role")
            if role not in ROLES:
                got = "missing" if "role" not in m else f"got {role!r}"
                raise ValueError(
                    f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, {got}"
                )
            content = m.get("content")
            if not isinstance(content, str):
                got = "missing" if "content" not in m else f"got {type(content).__name__}"
                raise ValueError(f"{where}: messages[{i}].content must be a string, {got}")
            out.append({"role": role, "content": content})
            fields.append(f"messages[{i}].content")
        return out, fields
    if "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if key not in obj:
                raise ValueError(
                    f'{where}: {key} is missing (a prompt record needs "prompt" and "completion")'
                )
            if not isinstance(obj[key], str):
                raise ValueError(f"{where}: {key} must be a string, got {type(obj[key]).__name__}")
        return (
            [
                {"role": "user", "content": obj["prompt"]},
                {"role": "assistant", "content": obj["completion"]},
            ],
            ["prompt", "completion"],
        )
    raise ValueError(
        f'{where}: a record needs "messages" or "prompt" and "completion"; it has '
        f"{sorted(obj) or 'no keys'}"
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """One rendered SFT record.

    Attributes:
      tokens: int64[N] the rendered record.
      weights: float64[N] 1.0 on loss targets (token-aligned; ``weights[0]`` is never used).
      where: the record's location (``"train.jsonl:12"``).
      truncated: the record was cut to the length limit.
    """

    tokens: np.ndarray
    weights: np.ndarray
    where: str
    truncated: bool = False

    @property
    def num_model_input(self) -> int:
        return int(self.tokens.shape[0]) - 1

    def as_sft(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(prompt, completion, mask)`` for `runner.sft.collate_sft` (the first token is the
        prompt: it is no target)."""
        return self.tokens[:1], self.tokens[1:], self.weights[1:]


def render_record(obj: Any, where: str, renderer: Renderer, *, train_on: str) -> Example:
    """Validates and renders one record (no length policy: see `fit_length`).

    Raises:
      ValueError: ``"<where>: <field>: <rule>"`` (`parse_record`, the renderer's errors, and a
        record with no assistant token to train on).
    """
    messages, fields = parse_record(obj, where)
    try:
        tokens, weights = renderer.render(messages, train_on=train_on)
    except MessageError as exc:
        raise ValueError(f"{where}: {fields[exc.index]}: {exc.detail}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if len(tokens) < 2 or not np.any(weights[1:]):
        raise ValueError(
            f"{where}: renders no assistant token to train on (the assistant content is empty, "
            "or it is the record's first token)"
        )
    return Example(tokens, weights, where)


def fit_length(example: Example, max_len: int, overflow: str) -> Example | None:
    """Applies the length policy: ``None`` when the record is dropped.

    Args:
      example: a rendered record.
      max_len: the model-input limit (``[model].max_seq_len``): at most ``max_len + 1`` tokens.
      overflow: one of `OVERFLOW`.

    Raises:
      ValueError: ``"error"`` and the record is too long; ``"truncate"`` leaves no target.
    """
    if overflow not in OVERFLOW:
        raise ValueError(f"[sft].overflow must be one of {OVERFLOW}, got {overflow!r}")
    n = example.num_model_input
    if n <= max_len:
        return example
    if overflow == "drop":
        return None
    if overflow == "error":
        raise ValueError(
            f"{example.where}: the record has {n} model-input tokens, over [model].max_seq_len = "
            f'{max_len}; set [sft].overflow = "truncate" or "drop", or raise the limit'
        )
    tokens, weights = example.tokens[: max_len + 1], example.weights[: max_len + 1]
    if not np.any(weights[1:]):
        raise ValueError(
            f"{example.where}: truncated to [model].max_seq_len = {max_len} model-input tokens, "
            'the record keeps no assistant token to train on; use [sft].overflow = "drop"'
        )
    return Example(tokens, weights, example.where, truncated=True)


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A JSONL file, validated and rendered.

    Attributes:
      path: the file as named in the config.
      examples: the kept records, in file order.
      lines: each kept record's line number.
      dropped, truncated: how many records the length policy dropped / truncated.
      sha256: the file's digest (a resume checks the data did not change).
    """

    path: str
    examples: tuple[Example, ...]
    lines: tuple[int, ...]
    dropped: int
    truncated: int
    sha256: str


def load_dataset(
    path: str, renderer: Renderer, *, train_on: str, max_len: int, overflow: str, key: str
) -> Dataset:
    """Reads, validates and renders a JSONL file of records, before any training.

    Args:
      path: the file.
      renderer: `runner.chat.renderer_for` the configured tokenizer.
      train_on: see `runner.chat.TRAIN_ON`.
      max_len, overflow: see `fit_length`.
      key: the config key naming the file (``"[sft].data"``), for a missing file.

    Raises:
      ValueError: naming the file, the line and the field for the first bad record; a file
        that is missing, empty, or left empty by ``overflow = "drop"``.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{key}: file not found: {path}")
    raw = p.read_bytes()
    examples, lines, dropped, truncated = [], [], 0, 0
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if not line.removeprefix(BOM if number == 1 else b"").strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = strict_json(line, first=number == 1)
        except JsonError as exc:
            raise ValueError(f"{where}: {exc}") from None
        example = fit_length(
            render_record(obj, where, renderer, train_on=train_on), max_len, overflow
        )
        if example is None:
            dropped += 1
            continue
        truncated += example.truncated
        examples.append(example)
        lines.append(number)
    if not examples:
        why = f"all {dropped} records are over the length limit" if dropped else "no records"
        raise ValueError(f"{key}: {path}: {why}")
    return Dataset(
        path=path,
        examples=tuple(examples),
        lines=tuple(lines),
        dropped=dropped,
        truncated=truncated,
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order epoch ``epoch`` visits ``n`` records in: a permutation drawn from
    ``(seed, epoch)`` (`numpy.random.default_rng([seed, 4, epoch])`), or ``0..n-1``."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, 4, epoch]).permutation(n)


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the next batch starts: ``index`` records of epoch ``epoch`` are consumed."""

    epoch: int = 0
    index: int = 0


class FileSource:
    """Batches of a `Dataset` by position (module docstring).

    Args:
      dataset: the training records.
      seed: the run's seed (epoch orders).
      batch_size: records per batch (``batch_tokens == 0``).
      batch_tokens: a token budget per batch (0: by ``batch_size``).
      shuffle: shuffle each epoch.
    """

    def __init__(
        self, dataset: Dataset, *, seed: int, batch_size: int, batch_tokens: int, shuffle: bool
    ):
        self.dataset = dataset
        self.seed, self.batch_size, self.batch_tokens, self.shuffle = (
            seed,
            batch_size,
            batch_tokens,
            shuffle,
        )
        self._orders: dict[int, np.ndarray] = {}
        self._sizes = np.asarray([len(e.tokens) for e in dataset.examples])

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(len(self._sizes), self.seed, epoch, self.shuffle)}
        return self._orders[epoch]

    def next_batch(self, pos: Position) -> tuple[list[int], Position]:
        """The indices (into ``dataset.examples``) of the batch at ``pos``, and the position
        after it."""
        n = len(self._sizes)
        order = self.order(pos.epoch)
        if self.batch_tokens:
            end, used = pos.index, 0
            while end < n and (
                end == pos.index or used + self._sizes[order[end]] <= self.batch_tokens
            ):
                used += int(self._sizes[order[end]])
                end += 1
        else:
            end = min(pos.index + self.batch_size, n)
        picked = [int(i) for i in order[pos.index : end]]
        after = Position(pos.epoch + 1, 0) if end >= n else Position(pos.epoch, end)
        return picked, after

    def steps_for_epochs(self, epochs: int) -> int:
        """How many batches ``epochs`` epochs take (``[sft].epochs``)."""
        steps, pos = 0, Position()
        while pos.epoch < epochs:
            _, pos = self.next_batch(pos)
            steps += 1
        return steps

    def position_state(self, pos: Position) -> dict[str, Any]:
        """The run-state record of ``pos`` (with the data's identity)."""
        return {
            "source": "file",
            "path": self.dataset.path,
            "sha256": self.dataset.sha256,
            "epoch": pos.epoch,
            "index": pos.index,
        }

    def restore(self, state: Mapping[str, Any] | None) -> Position:
        """The position a checkpoint recorded (fail closed when it is not this data's).

        Raises:
          ValueError: no file position in the checkpoint, or the file's digest changed.
        """
        if not isinstance(state, Mapping) or state.get("source") != "file":
            raise ValueError(
                f"--resume: the checkpoint records no position in [sft].data "
                f"({self.dataset.path}); it was not written by an SFT run on this file"
            )
        if state.get("sha256") != self.dataset.sha256:
            raise ValueError(
                f"--resume: [sft].data {self.dataset.path} changed since the checkpoint (sha256 "
                f"{str(state.get('sha256'))[:12]}… vs {self.dataset.sha256[:12]}…): the resumed "
                "run would not see the records the interrupted run would have"
            )
        epoch, index = state.get("epoch"), state.get("index")
        n = len(self._sizes)
        if not (
            isinstance(epoch, int) and isinstance(index, int) and 0 <= index < n and epoch >= 0
        ):
            raise ValueError(f"--resume: the checkpoint's data position {state!r} is invalid")
        return Position(epoch, index)


def as_sft_examples(examples: Sequence[Example]) -> list[tuple[np.ndarray, ...]]:
    """``collate_sft`` input for a batch."""
    return [e.as_sft() for e in examples]
