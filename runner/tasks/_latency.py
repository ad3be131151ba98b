"""An emulated tool latency for the shipped tasks (``[task.kwargs]`` ``latency_ms``, ``async_env``).

`with_latency` wraps one episode's environment so that every ``step`` first waits
``latency_ms`` milliseconds — a real ``time.sleep`` (a synchronous environment, run in the
concurrent rollout's thread pool) or, with ``async_env = true``, an ``asyncio.sleep`` in
``async def`` methods (a coroutine environment) — then answers exactly what the wrapped
environment answers. It stands in for an I/O-bound tool call, a sandbox or a grader.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from runner.tasks._protocol import StepResult


def check_latency(latency_ms: Any, async_env: Any) -> tuple[float, bool]:
    """Validates the two knobs (``ValueError`` naming the ``[task.kwargs]`` field)."""
    if isinstance(latency_ms, bool) or not isinstance(latency_ms, int | float):
        raise ValueError(f"[task.kwargs].latency_ms must be a number >= 0, got {latency_ms!r}")
    if not 0 <= latency_ms <= 60_000:
        raise ValueError(f"[task.kwargs].latency_ms must be in [0, 60000], got {latency_ms!r}")
    if not isinstance(async_env, bool):
        raise ValueError(f"[task.kwargs].async_env must be true or false, got {async_env!r}")
    return float(latency_ms), async_env


class _SleepyEnv:
    """A synchronous environment whose ``step`` sleeps first."""

    def __init__(self, env: Any, seconds: float):
        self.env, self.seconds = env, seconds

    def initial_observation(self) -> list[int]:
        return self.env.initial_observation()

    def step(self, action: list[int]) -> StepResult:
        time.sleep(self.seconds)
        return self.env.step(action)


class _AsyncEnv:
    """A coroutine environment (``async def`` methods) whose ``step`` awaits a sleep first."""

    def __init__(self, env: Any, seconds: float):
        self.env, self.seconds = env, seconds

    async def initial_observation(self) -> list[int]:
        return self.env.initial_observation()

    async def step(self, action: list[int]) -> StepResult:
        await asyncio.sleep(self.seconds)
        return self.env.step(action)


def with_latency(env: Any, latency_ms: float, async_env: bool) -> Any:
    """``env`` itself (no latency, synchronous), or wrapped (module docstring)."""
    if async_env:
        return _AsyncEnv(env, latency_ms / 1000.0)
    if latency_ms > 0:
        return _SleepyEnv(env, latency_ms / 1000.0)
    return env
