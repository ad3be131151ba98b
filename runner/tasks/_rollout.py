"""The runner's side of the task protocol: multi-turn rollouts and episodes → `runner.Seq`.

`rollout` drives ``group_size`` single-use environments per problem against a sampler (any
object with the `runner.Sampling` ``sample`` method) and checks everything an environment returns
(token ids inside the vocabulary, finite rewards and metrics, target flags matching the
observation) with errors naming the task, the problem and the turn. `episode_to_seq` builds the
target-aligned ``action_mask`` / ``obs_mask`` / ``sampling_logprobs`` (docs/conventions.md#data-conventions): actions are
the sampled turns (stop tokens included), observations the environment's tokens flagged by
``observation_targets``; the prompt is in neither.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from runner._seeds import call_seed
from runner._types import Seq, make_seq
from runner.tasks._load import LoadedTask
from runner.tasks._protocol import StepResult

#: How an episode ended (``stop/<reason>`` metrics).
STOP_DONE = "done"  # the environment said done
STOP_MAX_TURNS = "max_turns"  # task.max_turns actions
STOP_CONTEXT = "context_limit"  # the next turn might not fit [model].max_seq_len
STOP_REASONS = (STOP_DONE, STOP_MAX_TURNS, STOP_CONTEXT)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A span of an episode: ``kind`` is ``prompt``, ``action`` or ``observation``.

    ``logprobs`` are the sampler's (actions; zeros otherwise); ``targets`` are 1.0 on
    observation tokens that are ECHO targets (zeros otherwise).
    """

    kind: str
    tokens: np.ndarray
    logprobs: np.ndarray
    targets: np.ndarray


class RolloutError(ValueError):
    """A rollout failed for good (one line: the task, the problem, the turn, what happened)."""


def describe(exc: BaseException) -> str:
    """``"<type>: <first line>"`` of an exception (a timeout: the setting that bounds it)."""
    if isinstance(exc, TimeoutError):
        return "timed out ([rl].env_timeout_s)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def raised_at(exc: BaseException) -> str:
    """``"file.py:line"`` of the innermost frame of ``exc``'s traceback ("" without one): where in
    the task's own code it was raised."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename}:{tb.tb_lineno}"


def task_error(where: str, what: str, exc: BaseException) -> RolloutError:
    """The one line for an exception that the task's own code raised: the task, the problem (and
    turn) in ``where``, the method, the exception, and where it was raised."""
    at = raised_at(exc)
    return RolloutError(f"{where}: {what} raised {describe(exc)}" + (f" (at {at})" if at else ""))


def call_task(where: str, what: str, fn: Any, *args: Any) -> Any:
    """``resolve(fn(*args))``; an exception of the task's code becomes `task_error`."""
    try:
        return resolve(fn(*args))
    except Exception as exc:
        raise task_error(where, what, exc) from exc


def _short(problem: Any) -> str:
    text = repr(problem)
    return text if len(text) <= 60 else text[:57] + "..."


def resolve(value: Any) -> Any:
    """``value``, or what it returns when awaited: an ``async def`` environment method's result
    (run to completion on a private event loop; `runner.tasks._async` awaits it instead)."""
    if not inspect.isawaitable(value):
        return value
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()  # one loop for every call: loop-bound resources live on
    return _LOOP.run_until_complete(_await(value))


_LOOP: asyncio.AbstractEventLoop | None = None


async def _await(value: Any) -> Any:
    return await value


def _token_array(value: Any, where: str, what: str, vocab_size: int) -> np.ndarray:
    try:
        arr = np.asarray(list(value))
    except TypeError:
        raise ValueError(
            f"{where}: {what} must be a sequence of token ids, got {value!r}"
        ) from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: {what} must be a flat sequence of integer token ids")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        j = int(np.argmax(bad))
        raise ValueError(
            f"{where}: {what} token {int(arr[j])} at position {j} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return arr.astype(np.int64)


class Episode:
    """One episode of a task: the prompt, then actions and observations.

    Attributes:
      problem, index: the problem and its position in the step's list (for messages).
      segments: `Segment` list, starting with the prompt.
      done, reward, stop: the state; ``reward`` sums the steps' rewards; ``stop`` is one of
        `STOP_REASONS` once done.
      metrics: the steps' metrics, summed.
      num_turns: actions so far.
    """

    def __init__(
        self,
        task: LoadedTask,
        problem: Any,
        index: int,
        max_seq_len: int | None,
        *,
        start: bool = True,
    ):
        self.task, self.problem, self.index = task, problem, index
        self.max_seq_len = max_seq_len
        self.where = f"task {task.name}: problem {index} ({_short(problem)})"
        self.env = call_task(self.where, "make_env", task.task.make_env, problem)
        self.segments: list[Segment] = []
        self.done, self.reward, self.stop = False, 0.0, ""
        self.metrics: dict[str, float] = {}
        self.num_turns = 0
        self.versions: list[int] = []  # the policy version of each action (concurrent rollouts)
        if start:
            self.begin(
                call_task(
                    f"{self.where}, turn 0", "initial_observation", self.env.initial_observation
                )
            )

    def begin(self, observation: Any) -> None:
        """Checks the environment's ``initial_observation()`` and makes it the prompt."""
        prompt = _token_array(
            observation, f"{self.where}, turn 0", "initial_observation()", self.task.vocab_size
        )
        if len(prompt) == 0:
            raise ValueError(f"{self.where}, turn 0: initial_observation() is empty")
        max_seq_len = self.max_seq_len
        if max_seq_len is not None and len(prompt) > max_seq_len:
            raise ValueError(
                f"{self.where}, turn 0: the prompt has {len(prompt)} tokens, leaving no room for "
                f"an action within [model].max_seq_len = {max_seq_len}"
            )
        zeros = np.zeros(len(prompt))
        self.segments = [Segment("prompt", prompt, zeros, zeros)]

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([s.tokens for s in self.segments])

    def add_action(self, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Appends one policy turn, steps the environment, and appends its observation unless the
        episode ends (done, or ``max_turns``)."""
        where = f"{self.where}, turn {self.num_turns}"
        result = call_task(where, "env.step", self.env.step, [int(t) for t in tokens])
        self.record(tokens, logprobs, result)

    def record(self, tokens: np.ndarray, logprobs: np.ndarray, result: Any) -> None:
        """Checks what ``env.step`` answered to the action ``tokens`` and appends both."""
        where = f"{self.where}, turn {self.num_turns}"
        if not isinstance(result, StepResult):
            raise ValueError(
                f"{where}: env.step returned {type(result).__name__}, expected a "
                "runner.tasks.StepResult"
            )
        reward = result.reward
        if isinstance(reward, bool) or not isinstance(reward, int | float | np.number):
            raise ValueError(f"{where}: the reward must be a number, got {reward!r}")
        if not math.isfinite(float(reward)):
            raise ValueError(f"{where}: the reward is {float(reward)}; rewards must be finite")
        if not isinstance(result.done, bool | np.bool_):
            raise ValueError(f"{where}: done must be a bool, got {result.done!r}")
        for key, value in dict(result.metrics).items():
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise ValueError(f"{where}: metric {key!r} must be a number, got {value!r}")
            if not math.isfinite(float(value)):
                raise ValueError(f"{where}: metric {key!r} is {float(value)}, not finite")
            self.metrics[str(key)] = self.metrics.get(str(key), 0.0) + float(value)
        obs = _token_array(result.observation, where, "the observation", self.task.vocab_size)
        if result.observation_targets is None:
            targets = np.ones(len(obs))
        else:
            flags = np.asarray(list(result.observation_targets))
            if flags.shape != obs.shape:
                raise ValueError(
                    f"{where}: observation_targets has {flags.size} flags for {len(obs)} "
                    "observation tokens (one bool per token, or None)"
                )
            targets = flags.astype(np.float64)
            if not np.all((targets == 0) | (targets == 1)):
                raise ValueError(f"{where}: observation_targets must be booleans")
        zeros = np.zeros(len(tokens))
        self.segments.append(Segment("action", tokens, logprobs, zeros))
        self.num_turns += 1
        self.reward += float(reward)
        if result.done:
            self.done, self.stop = True, STOP_DONE
        elif self.num_turns >= self.task.max_turns:
            self.done, self.stop = True, STOP_MAX_TURNS
        elif len(obs):
            self.segments.append(Segment("observation", obs, np.zeros(len(obs)), targets))

    def terminate(self, stop: str) -> None:
        """Ends the episode from outside the environment (its reward so far is kept), dropping a
        trailing observation (no policy turn will condition on it)."""
        if self.segments[-1].kind == "observation":
            self.segments.pop()
        self.done, self.stop = True, stop


def episode_to_seq(episode: Episode) -> Seq:
    """An episode as a `runner.Seq` with target-aligned ``action_mask``, ``obs_mask`` (the
    observation targets) and ``sampling_logprobs`` (on action tokens)."""
    cat = np.concatenate
    segs = episode.segments
    action = cat([np.full(len(s.tokens), float(s.kind == "action")) for s in segs])
    return make_seq(
        episode.tokens,
        action_mask=action[1:],
        obs_mask=cat([s.targets for s in segs])[1:],
        sampling_logprobs=(cat([s.logprobs for s in segs]) * action)[1:],
    )


def _cut_at_stop(tokens: np.ndarray, logprobs: np.ndarray, stops: Sequence[int]):
    hits = np.flatnonzero(np.isin(tokens, stops))
    if hits.size:
        end = int(hits[0]) + 1
        return tokens[:end], logprobs[:end]
    return tokens, logprobs


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` of a rollout seeded ``seed`` (below 2^19, so that
    every backend's wire seeds fit int32: `runner._seeds`)."""
    return call_seed(seed, turn)


def rollout(
    sampler: Any,
    task: LoadedTask,
    problems: Sequence[Any],
    *,
    group_size: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_seq_len: int | None = None,
) -> list[list[Episode]]:
    """Runs ``group_size`` episodes per problem, one ``sample`` call per turn.

    Turn 0 samples ``group_size`` completions of each problem's prompt in one call when every
    group's environments share their prompt (else one completion per episode); each later turn
    samples one continuation of every unfinished episode (its tokens so far). A turn stops at one
    of ``task.stop_token_ids`` or after ``task.max_tokens_per_turn`` tokens (a sample running past
    its first stop token is cut there). Turn ``t`` samples with seed ``turn_seed(seed, t)``. With
    ``max_seq_len``, an episode whose next turn might not fit (``len(tokens) +
    max_tokens_per_turn - 1 > max_seq_len``) ends with ``stop = "context_limit"``.

    Returns:
      ``groups[i][k]``: finished `Episode` ``k`` of problem ``i``.

    Raises:
      ValueError: naming the task, the problem and the turn, for anything an environment returns
        that breaks the protocol; a sampler returning the wrong number of samples.
    """
    if not (isinstance(group_size, int) and group_size >= 1):
        raise ValueError(f"rollout: group_size must be an int >= 1, got {group_size!r}")
    limit = task.max_tokens_per_turn
    groups = [
        [Episode(task, p, i, max_seq_len) for _ in range(group_size)]
        for i, p in enumerate(problems)
    ]
    shared = all(all(np.array_equal(e.tokens, g[0].tokens) for e in g[1:]) for g in groups)
    turn = 0
    active = [e for g in groups for e in g]
    while True:
        if max_seq_len is not None:
            for e in active:
                if len(e.tokens) + limit - 1 > max_seq_len:
                    e.terminate(STOP_CONTEXT)
            active = [e for e in active if not e.done]
        if not active:
            break
        if turn == 0 and shared:  # one call, group_size samples per prompt
            prompts = [g[0].tokens.tolist() for g in groups if not g[0].done]
            n = group_size
        else:
            prompts = [e.tokens.tolist() for e in active]
            n = 1
        samples = sampler.sample(
            prompts,
            num_samples=n,
            max_tokens=limit,
            temperature=temperature,
            seed=turn_seed(seed, turn),
            stop_token_ids=task.stop_token_ids,
        )
        if len(samples) != len(prompts) or any(len(s) != n for s in samples):
            raise ValueError(
                f"rollout: sample() returned {[len(s) for s in samples]} samples for "
                f"{len(prompts)} prompts, expected {n} each"
            )
        flat = [s for per_prompt in samples for s in per_prompt]
        for episode, sample in zip(active, flat, strict=True):
            toks = np.asarray(sample.tokens, dtype=np.int64).reshape(-1)[:limit]
            lps = np.asarray(sample.logprobs, dtype=np.float64).reshape(-1)[: len(toks)]
            episode.add_action(*_cut_at_stop(toks, lps, task.stop_token_ids))
        active = [e for e in active if not e.done]
        turn += 1
    for g in groups:
        apply_group_rewards(task, g)
    return groups


def apply_group_rewards(task: LoadedTask, episodes: Sequence[Episode]) -> None:
    """Replaces the episodes' rewards by the task's ``group_rewards(problem, episodes)`` when it
    has that hook (`set_group_rewards`); else leaves them as they are."""
    if task.has_group_rewards and episodes:
        values = call_task(
            episodes[0].where,
            "group_rewards",
            task.task.group_rewards,
            episodes[0].problem,
            list(episodes),
        )
        set_group_rewards(episodes, values)


def set_group_rewards(episodes: Sequence[Episode], values: Any) -> None:
    """Checks ``group_rewards``' answer (one finite number per episode) and sets the rewards."""
    where = episodes[0].where
    try:
        rewards = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: group_rewards returned {values!r}, expected one number per episode"
        ) from None
    if len(rewards) != len(episodes) or not all(math.isfinite(r) for r in rewards):
        raise ValueError(
            f"{where}: group_rewards returned {len(rewards)} rewards for {len(episodes)} "
            "episodes (one finite number each)"
        )
    for e, r in zip(episodes, rewards, strict=True):
        e.reward = r


def rollout_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``stop/<reason>`` fractions and ``env/<metric>`` means over episodes."""
    n = max(len(episodes), 1)
    out = {f"stop/{r}": sum(e.stop == r for e in episodes) / n for r in STOP_REASONS}
    keys = sorted({k for e in episodes for k in e.metrics})
    for k in keys:
        out[f"env/{k}"] = sum(e.metrics.get(k, 0.0) for e in episodes) / n
    return out
