"""A rich progress bar with the live reward (a no-op when disabled or not on a terminal)."""

from __future__ import annotations

import math
from typing import Any


class Progress:
    """``with Progress(total, start) as bar: bar.update(step, record)``."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total, self.start, self.enabled = total, start, enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.enabled:
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
        if self._progress is None:
            return
        parts = []
        for key, label, fmt in (
            ("reward", "reward", ".3f"),
            ("sft/nll", "nll", ".3f"),
            ("env_nll", "env nll", ".3f"),
            ("eval_reward", "eval", ".3f"),
            ("tokens_per_s", "tok/s", ".0f"),
        ):
            value = record.get(key)
            if isinstance(value, float) and math.isfinite(value):
                parts.append(f"{label} {value:{fmt}}")
        self._progress.update(
            self._task, completed=step, phase=record.get("phase", ""), stats="  ".join(parts)
        )

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
