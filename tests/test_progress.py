"""Progress without a terminal (`runner.progress`): plain lines every few steps, at the last
step and after a minute of silence (the CLI's lines on stdout: tests/test_main_job.py's
reference run)."""

from __future__ import annotations

import io
import re

import pytest

from runner import progress as progress_mod
from runner.progress import Progress

LINE = re.compile(r"^step (\d+)/(\d+)  (sft|rl)(  .+)?  \d+:\d\d:\d\d$")


@pytest.mark.parametrize("total, start, every", [(40, 0, 2), (7, 0, 1), (100, 60, 2), (3, 2, 1)])
def test_lines_come_every_few_steps_and_at_the_last(total, start, every):
    out = io.StringIO()
    with Progress(total, start, mode="lines", stream=out) as bar:
        assert bar.every == every
        for step in range(start + 1, total + 1):
            bar.update(step, {"phase": "rl", "reward": 0.25 * (step % 4), "sft/nll": float("nan")})
    lines = out.getvalue().splitlines()
    steps = [int(LINE.match(line).group(1)) for line in lines]
    want = [s for s in range(start + 1, total + 1) if (s - start) % every == 0 or s == total]
    assert steps == want and len(lines) <= 21
    assert all("nll" not in line for line in lines)  # a non-finite value is left out
    assert "reward 0.500" in lines[0] or every > 1 or start + 1 != 2


def test_a_silent_minute_prints_a_line(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    with Progress(100, 0, mode="lines", stream=out) as bar:
        bar.update(1, {"phase": "sft"})  # not due (every 5)
        clock[0] = progress_mod.LINE_EVERY_S + 1
        bar.update(2, {"phase": "sft"})  # due: a minute since the start
    assert out.getvalue().splitlines() == ["step 2/100  sft  0:01:01"]


def test_modes_are_checked():
    with pytest.raises(ValueError, match="mode must be one of"):
        Progress(3, mode="dots")
    assert Progress(3, enabled=False).mode == "off" and Progress(3).mode == "bar"
