"""The task protocol: what a user implements to train the runner on their environment.

Synchronous and token-level (docs/tasks.md#the-task-protocol). A `Task` poses problems and makes
one single-use `Env` per episode; the runner samples ``[rl].group_size`` episodes per problem:

1. ``env.initial_observation()`` — the prompt tokens (never a loss target);
2. the policy samples one turn (up to ``task.max_tokens_per_turn`` tokens, ending at one of
   ``task.stop_token_ids``, the stop token included in the action);
3. ``env.step(action)`` → `StepResult`: the reward of this step (an episode's reward is the sum),
   whether the episode is done, and the tokens the environment appends before the next turn
   (``observation``, only the new ones), with ``observation_targets`` marking which of them ECHO
   predicts (``None``: all of them);
4. repeat from 2 until ``done``, or ``task.max_turns`` actions, or the next turn might not fit
   the trainer's context (``[model].max_seq_len``): then the episode ends without its trailing
   observation (``stop/context_limit``).

Optional methods, probed once when the task is loaded (`runner.tasks.LoadedTask`):
``eval_problems() -> list`` (a fixed held-out set; default: 64 problems drawn from a fixed RNG),
``demonstrations(rng, n) -> list[record]`` (SFT records in the ``[sft].data`` JSONL format, for the
warm-up without a data file) and ``max_prompt_tokens() -> int`` (the longest prompt, checked
against ``[model].max_seq_len`` before any work), ``group_rewards(problem, episodes) -> list``
(rewards that compare a group's finished episodes, e.g. a pairwise judge, replacing their summed
step rewards; one finite number per episode) and ``cleanup()`` (once, when the run ends).

Asynchronous environments: ``initial_observation`` and ``step`` may be coroutines (``async
def``), and so may ``group_rewards`` and ``cleanup``. With ``[rl].rollout = "concurrent"`` the
episodes of a step run concurrently (coroutines on one event loop, synchronous environments in a
pool of ``[rl].env_workers`` threads); with the default lock-step rollout a coroutine is awaited
where the synchronous method would have been called.

An environment that raises `RecoverableError` (a flaky tool, a sandbox that timed out) loses
that episode only, under ``[rl].rollout = "concurrent"`` (`runner.tasks._async`); any other
exception stops the run with one line naming the task, the problem and the turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment answers to one policy turn.

    Attributes:
      reward: this step's reward (finite); the episode's reward is the sum over its steps.
      done: the episode is over (no observation is appended after a final step).
      observation: token ids the environment appends before the next turn.
      observation_targets: one bool per observation token, True where it is an ECHO target
        (``obs_mask``); ``None``: every observation token is a target.
      metrics: numbers summed over the episode and averaged over a step's episodes
        (``env/<name>`` in the metrics).
    """

    reward: float
    done: bool
    observation: Sequence[int] = ()
    observation_targets: Sequence[bool] | None = None
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One episode (single use)."""

    def initial_observation(self) -> list[int]:
        """The prompt tokens (never a loss target)."""
        ...

    def step(self, action: list[int]) -> StepResult:
        """One policy turn, its stop token included when it has one."""
        ...


@runtime_checkable
class Task(Protocol):
    """Problems and environments (module docstring)."""

    stop_token_ids: Sequence[int]
    max_turns: int
    max_tokens_per_turn: int

    def problems(self, rng: np.random.Generator, n: int) -> list[Any]:
        """One step's ``n`` problems, drawn with ``rng`` (seeded per step: exact resume)."""
        ...

    def make_env(self, problem: Any) -> Env:
        """A fresh environment for one episode of ``problem``."""
        ...


@runtime_checkable
class HasEvalProblems(Protocol):
    def eval_problems(self) -> list[Any]: ...


@runtime_checkable
class HasDemonstrations(Protocol):
    def demonstrations(self, rng: np.random.Generator, n: int) -> list[Any]: ...


@runtime_checkable
class HasMaxPromptTokens(Protocol):
    def max_prompt_tokens(self) -> int: ...


@runtime_checkable
class HasGroupRewards(Protocol):
    def group_rewards(self, problem: Any, episodes: list[Any]) -> Sequence[float]: ...


@runtime_checkable
class HasCleanup(Protocol):
    def cleanup(self) -> None: ...


class RecoverableError(Exception):
    """Raised by an environment for a failure that should drop one episode, not the run."""
