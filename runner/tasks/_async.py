"""Concurrent rollouts: independent episodes, environments that overlap, one batched sampler.

The lock-step `runner.tasks.rollout` samples turn ``t`` of every episode, then steps every
environment one after another, then samples turn ``t + 1``. Here each episode is a coroutine on
one event loop that requests its next turn as soon as its environment has answered:

* `EnvCalls` runs an environment method: a coroutine (``async def``) is awaited on the loop; a
  synchronous method runs in a bounded thread pool (``[rl].env_workers`` threads), so the
  environments of a step overlap either way. ``[rl].env_timeout_s`` bounds every call.
* `SampleBatcher` gathers the pending turn requests of all episodes into one backend ``sample``
  call: it waits until every live episode that is not inside its environment has asked, or
  ``[rl].sample_batch_ms`` after the first request, whichever comes first, so concurrency costs
  no sampler efficiency. One backend call runs at a time, in its own thread, so the event loop
  (and the environments) go on while the model samples.
* `stream_key` is the one rule for sampling seeds: turn ``turn`` of sample ``sample`` of problem
  ``problem`` of a step seeded ``step_seed`` draws from the random stream ``(call seed, index)``
  that `stream_key` derives from those four numbers. A backend whose ``sample`` takes ``row_offsets`` (the local trainer:
  a row's completion depends only on the seed, that index, its tokens and the weights) then
  samples exactly the same tokens whatever order the requests arrived in and however they were
  batched; other backends (hosted, whose wire seeds must fit int32) get a call seed below
  ``2^19`` drawn from the step's seed and the call's first index and size (`runner._seeds.
  call_seed`), and a request's index is its position in the call.
* `run_episode` drives one `runner.tasks.Episode` with the same checks, turn limits and context
  limit as the lock-step rollout, and tags each action with the policy version that sampled it.

Scheduling across steps (admission, staleness, training) is `runner._pipeline`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runner._seeds import call_seed
from runner.tasks._protocol import RecoverableError
from runner.tasks._rollout import (
    STOP_CONTEXT,
    Episode,
    RolloutError,
    _cut_at_stop,
    describe,
    task_error,
)

#: Streams per step: the index of `stream_key` stays below this (local sampler's bound).
MAX_STREAM_INDEX = 2**31
#: HTTP statuses of a sampler that are worth another try (timeout, rate limit, server errors).
RECOVERABLE_STATUS = (408, 429)


class EpisodeFailed(Exception):
    """An episode lost to a recoverable failure (`is_recoverable`); its group may go on."""

    def __init__(self, where: str, cause: BaseException):
        super().__init__(f"{where}: {describe(cause)}")
        self.cause = cause


def is_recoverable(exc: BaseException) -> bool:
    """A timeout, a connection error, `runner.tasks.RecoverableError`, or an error carrying an
    HTTP status 408, 429 or 5xx (``status_code`` / ``status``)."""
    if isinstance(exc, RecoverableError | TimeoutError | ConnectionError):
        return True
    status = getattr(exc, "status_code", getattr(exc, "status", None))
    return isinstance(status, int) and (status in RECOVERABLE_STATUS or 500 <= status < 600)


class CircuitBreaker:
    """Stops a run whose environments keep failing: after ``consecutive`` recoverable failures
    in a row, or when at least ``ratio`` of the last ``window`` episodes failed (once
    ``min_seen`` have been seen)."""

    def __init__(
        self, *, consecutive: int = 5, window: int = 20, ratio: float = 0.5, min_seen: int = 10
    ):
        self.consecutive, self.window, self.ratio, self.min_seen = (
            consecutive,
            window,
            ratio,
            min_seen,
        )
        self.recent: list[bool] = []
        self.streak = 0

    def observe(self, failed: bool, why: str = "") -> None:
        """Records one episode's outcome; raises `RolloutError` when the breaker trips."""
        self.recent = (self.recent + [failed])[-self.window :]
        self.streak = self.streak + 1 if failed else 0
        share = sum(self.recent) / len(self.recent)
        if self.streak >= self.consecutive or (
            len(self.recent) >= self.min_seen and share >= self.ratio
        ):
            raise RolloutError(
                f"rollouts keep failing ({self.streak} in a row, {sum(self.recent)} of the last "
                f"{len(self.recent)} episodes); the last: {why}"
            )


def stream_key(
    step_seed: int, *, problem: int, sample: int, turn: int, problems: int, group_size: int
) -> tuple[int, int]:
    """``(call seed, stream index)`` of one turn request: the step's seed, and an index that
    numbers ``(turn, problem, sample)`` within the step (so the pending requests of one step,
    whatever their turns, go in one backend call).

    The only place a concurrent rollout's sampling seeds are derived (hosted backends encode
    ``(call seed, index)`` further, `runner._seeds`).
    """
    if not (0 <= problem < problems and 0 <= sample < group_size and turn >= 0):
        raise ValueError(
            f"stream_key: problem {problem} / sample {sample} / turn {turn} outside the step's "
            f"{problems} x {group_size} episodes"
        )
    index = (turn * problems + problem) * group_size + sample
    if index >= MAX_STREAM_INDEX:
        raise ValueError(f"stream_key: index {index} of turn {turn} is >= 2**31")
    return int(step_seed), index


def takes_row_offsets(sampler: Any) -> bool:
    """Whether ``sampler.sample`` takes ``row_offsets``, each prompt's random-stream row (the
    local trainer; probed once per rollout service)."""
    try:
        return "row_offsets" in inspect.signature(sampler.sample).parameters
    except (TypeError, ValueError):
        return False


async def bounded(awaitable: Any, timeout_s: float | None) -> Any:
    """``await awaitable`` within ``timeout_s`` seconds (``None`` or 0: unbounded; ``TimeoutError``
    past it).

    ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` loses a
    cancellation that arrives as its inner future completes (the task goes on as if never
    cancelled), which left a stopped rollout service waiting forever on an episode that had
    swallowed its cancel.
    """
    if not timeout_s:
        return await awaitable
    async with asyncio.timeout(timeout_s):
        return await awaitable


class EnvCalls:
    """Runs environment methods: coroutines on the loop, synchronous ones in a thread pool.

    Args:
      workers: threads for synchronous environments (``[rl].env_workers``).
      timeout_s: the bound on one call (0: none). A timed-out synchronous call keeps its thread
        until it returns (Python cannot stop a thread); its result is discarded.
    """

    def __init__(self, *, workers: int, timeout_s: float = 0.0):
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="env")
        self.timeout_s = timeout_s

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            pending: Any = fn(*args)
        else:
            pending = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        value = await bounded(pending, self.timeout_s)
        if inspect.isawaitable(value):  # a synchronous method that returned a coroutine
            value = await bounded(value, self.timeout_s)
        return value

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class SampleBatcher:
    """One backend ``sample`` call for all pending turn requests (module docstring).

    Args:
      sampler: a `runner.Sampling` backend.
      max_tokens, temperature, stop_token_ids: of every turn.
      batch_ms: the longest wait after the first pending request (``[rl].sample_batch_ms``).
      expected: how many requests can arrive without an environment answering first (the live
        episodes not inside an environment call); reaching it flushes at once.
      version: the published policy version, read when a call starts (each sample's tag).
    """

    def __init__(
        self,
        sampler: Any,
        *,
        max_tokens: int,
        temperature: float,
        stop_token_ids: Sequence[int],
        batch_ms: float,
        expected: Callable[[], int],
        version: Callable[[], int],
    ):
        self.sampler, self.max_tokens, self.temperature = sampler, max_tokens, temperature
        self.stop_token_ids = tuple(stop_token_ids)
        self.batch_s = batch_ms / 1000.0
        self.expected, self.version = expected, version
        self.indexed = takes_row_offsets(sampler)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler")
        self.pending: list[tuple[list[int], tuple[int, int], asyncio.Future]] = []
        self.calls = 0  # backend calls made
        self.rows = 0  # requests served
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def sample(self, prompt: list[int], key: tuple[int, int]) -> tuple[Any, int]:
        """``(Sample, version)`` of one turn of ``prompt`` with stream ``key`` (`stream_key`)."""
        future = asyncio.get_running_loop().create_future()
        self.pending.append((prompt, key, future))
        self._wake.set()
        return await future

    def poke(self) -> None:
        """Re-checks the flush rule (an episode ended or entered its environment)."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.pending:
                continue
            deadline = loop.time() + self.batch_s
            while len(self.pending) < self.expected() and loop.time() < deadline:
                try:
                    async with asyncio.timeout_at(deadline):
                        await self._wake.wait()
                except TimeoutError:
                    break
                self._wake.clear()
            batch, self.pending = self.pending, []
            await self._flush(batch)

    async def _flush(self, batch: list) -> None:
        by_seed: dict[int, list] = {}
        for item in batch:
            by_seed.setdefault(item[1][0], []).append(item)
        loop = asyncio.get_running_loop()
        for seed, items in by_seed.items():
            version = self.version()
            try:
                samples = await loop.run_in_executor(self.pool, self._call, seed, items)
            except Exception as exc:  # every waiting episode sees the sampler's error
                for *_, future in items:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (*_, future), sample in zip(items, samples, strict=True):
                if not future.done():
                    future.set_result((sample, version))

    def _call(self, seed: int, items: list) -> list:
        prompts = [p for p, _, _ in items]
        kwargs: dict[str, Any] = {}
        if self.indexed:
            kwargs["row_offsets"] = [k[1] for _, k, _ in items]
        else:  # a hosted backend numbers the call's rows itself: one seed per distinct call
            seed = call_seed(seed, min(k[1] for _, k, _ in items), len(items))
        out = self.sampler.sample(
            prompts,
            num_samples=1,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            **kwargs,
        )
        if len(out) != len(prompts) or any(len(s) != 1 for s in out):
            raise ValueError(
                f"rollout: sample() returned {[len(s) for s in out]} samples for "
                f"{len(prompts)} prompts, expected 1 each"
            )
        self.calls += 1
        self.rows += len(prompts)
        return [s[0] for s in out]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.pool.shutdown(wait=True)


class Activity:
    """Live episodes and those inside an environment call (the batcher's flush rule)."""

    def __init__(self) -> None:
        self.live = 0
        self.in_env = 0

    def waiting(self) -> int:
        return self.live - self.in_env


async def run_episode(
    episode: Episode,
    *,
    step_seed: int,
    sample: int,
    problems: int,
    group_size: int,
    envs: EnvCalls,
    batcher: SampleBatcher,
    activity: Activity,
) -> Episode:
    """Runs one episode to its end (`runner.tasks.rollout`'s rules, one episode at a time).

    ``activity.live`` counts this episode from before the call; it is released here.
    """
    task = episode.task
    limit = task.max_tokens_per_turn
    activity.in_env += 1
    try:
        try:
            observation = await _env_call(envs, episode, 0, "initial_observation()", ())
        finally:
            activity.in_env -= 1
        episode.begin(observation)
        turn = 0
        while not episode.done:
            if (
                episode.max_seq_len is not None
                and len(episode.tokens) + limit - 1 > episode.max_seq_len
            ):
                episode.terminate(STOP_CONTEXT)
                break
            key = stream_key(
                step_seed,
                problem=episode.index,
                sample=sample,
                turn=turn,
                problems=problems,
                group_size=group_size,
            )
            try:
                drawn, version = await batcher.sample(episode.tokens.tolist(), key)
            except Exception as exc:
                where = f"{episode.where}, turn {turn}"
                if is_recoverable(exc):
                    raise EpisodeFailed(where, exc) from exc
                raise RolloutError(f"{where}: sample() failed: {describe(exc)}") from exc
            toks = np.asarray(drawn.tokens, dtype=np.int64).reshape(-1)[:limit]
            lps = np.asarray(drawn.logprobs, dtype=np.float64).reshape(-1)[: len(toks)]
            toks, lps = _cut_at_stop(toks, lps, task.stop_token_ids)
            activity.in_env += 1
            batcher.poke()
            try:
                result = await _env_call(envs, episode, turn, "env.step", ([int(t) for t in toks],))
            finally:
                activity.in_env -= 1
            episode.record(toks, lps, result)
            episode.versions.append(version)
            turn += 1
        return episode
    finally:
        activity.live -= 1
        batcher.poke()


async def _env_call(envs: EnvCalls, episode: Episode, turn: int, what: str, args: tuple) -> Any:
    """One environment call; a recoverable failure becomes `EpisodeFailed`, any other exception
    one `RolloutError` line naming the task, the problem and the turn."""
    fn = episode.env.step if what == "env.step" else episode.env.initial_observation
    try:
        return await envs.call(fn, *args)
    except Exception as exc:
        where = f"{episode.where}, turn {turn}"
        if is_recoverable(exc):
            raise EpisodeFailed(where, exc) from exc
        raise task_error(where, what, exc) from exc


async def _rollout(
    sampler: Any,
    task: Any,
    problems: Sequence[Any],
    *,
    group_size: int,
    temperature: float,
    seed: int,
    max_seq_len: int | None,
    env_workers: int,
    sample_batch_ms: float,
) -> list[list[Episode]]:
    from runner.tasks._rollout import set_group_rewards

    activity = Activity()
    envs = EnvCalls(workers=env_workers)
    batcher = SampleBatcher(
        sampler,
        max_tokens=task.max_tokens_per_turn,
        temperature=temperature,
        stop_token_ids=task.stop_token_ids,
        batch_ms=sample_batch_ms,
        expected=activity.waiting,
        version=lambda: 0,
    )
    batcher.start()
    try:
        groups = [
            [Episode(task, p, i, max_seq_len, start=False) for _ in range(group_size)]
            for i, p in enumerate(problems)
        ]
        activity.live = len(problems) * group_size
        await asyncio.gather(
            *(
                run_episode(
                    e,
                    step_seed=seed,
                    sample=k,
                    problems=len(problems),
                    group_size=group_size,
                    envs=envs,
                    batcher=batcher,
                    activity=activity,
                )
                for g in groups
                for k, e in enumerate(g)
            )
        )
        if task.has_group_rewards:
            for g in groups:
                try:
                    values = await envs.call(task.task.group_rewards, g[0].problem, g)
                except Exception as exc:
                    raise task_error(g[0].where, "group_rewards", exc) from exc
                set_group_rewards(g, values)
        return groups
    finally:
        await batcher.close()
        envs.close()


def concurrent_rollout(
    sampler: Any,
    task: Any,
    problems: Sequence[Any],
    *,
    group_size: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_seq_len: int | None = None,
    env_workers: int = 64,
    sample_batch_ms: float = 5.0,
) -> list[list[Episode]]:
    """`runner.tasks.rollout`'s contract with concurrent episodes (module docstring), for one
    batch of problems (the held-out evaluation of a concurrent run): ``groups[i][k]``."""
    return asyncio.run(
        _rollout(
            sampler,
            task,
            problems,
            group_size=group_size,
            temperature=temperature,
            seed=seed,
            max_seq_len=max_seq_len,
            env_workers=env_workers,
            sample_batch_ms=sample_batch_ms,
        )
    )
