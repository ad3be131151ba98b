"""Progress of a run: a rich progress bar with the live reward on a terminal, plain lines
without one (a log file, CI, ``nohup``), nothing when disabled.

Without a terminal a bar would print nothing until the end; `Progress` in ``"lines"`` mode
prints one line every `Progress.every` steps (about 20 a run), after at most
`LINE_EVERY_S` seconds of silence, and at the last step:
``step 12/40  rl  reward 0.375  eval 0.344  tok/s 5120  0:01:02``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

#: ``Progress`` modes.
MODES = ("bar", "lines", "off")
#: In ``"lines"`` mode, a step's line is printed when this long has passed since the last one.
LINE_EVERY_S = 60.0
#: The record's fields shown, as ``(key, label, format)``.
FIELDS = (
    ("reward", "reward", ".3f"),
    ("sft/nll", "nll", ".3f"),
    ("env_nll", "env nll", ".3f"),
    ("eval_reward", "eval", ".3f"),
    ("tokens_per_s", "tok/s", ".0f"),
)


def stats(record: dict[str, Any]) -> str:
    """The finite `FIELDS` of a step's record, ``"reward 0.375  nll 1.234"``."""
    parts = []
    for key, label, fmt in FIELDS:
        value = record.get(key)
        if isinstance(value, float) and math.isfinite(value):
            parts.append(f"{label} {value:{fmt}}")
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """``with Progress(total, start, mode=...) as bar: bar.update(step, record)``.

    Args:
      total: the run's last step.
      start: the step already done (a resume's checkpoint).
      mode: ``"bar"`` (rich, on a terminal), ``"lines"`` (plain lines to ``stream``) or
        ``"off"``. ``enabled`` (bool) is the older spelling: True is ``"bar"``.
      stream: where ``"lines"`` go (standard output by default).
    """

    def __init__(
        self,
        total: int,
        start: int = 0,
        enabled: bool | None = None,
        *,
        mode: str | None = None,
        stream: TextIO | None = None,
    ):
        if mode is None:
            mode = "bar" if enabled or enabled is None else "off"
        if mode not in MODES:
            raise ValueError(f"Progress: mode must be one of {MODES}, got {mode!r}")
        self.total, self.start, self.mode = total, start, mode
        self.enabled = mode != "off"
        self.stream = stream
        #: ``"lines"``: a line every this many steps.
        self.every = max(1, math.ceil(max(total - start, 1) / 20))
        self._progress = None
        self._task = None
        self._t0 = self._last_line = time.monotonic()

    def __enter__(self) -> Progress:
        self._t0 = self._last_line = time.monotonic()
        if self.mode == "bar":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]{task.fields[phase]}[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(
                "train", total=self.total, completed=self.start, phase="start", stats=""
            )
        return self

    def update(self, step: int, record: dict[str, Any]) -> None:
        if self.mode == "lines":
            self._line(step, record)
        if self._progress is None:
            return
        self._progress.update(
            self._task, completed=step, phase=record.get("phase", ""), stats=stats(record)
        )

    def _line(self, step: int, record: dict[str, Any]) -> None:
        now = time.monotonic()
        due = (step - self.start) % self.every == 0 or now - self._last_line >= LINE_EVERY_S
        if not (due or step >= self.total):
            return
        self._last_line = now
        parts = [f"step {step}/{self.total}", str(record.get("phase", "")), stats(record)]
        parts.append(_clock(now - self._t0))
        print("  ".join(p for p in parts if p), file=self.stream or sys.stdout, flush=True)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
