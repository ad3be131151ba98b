"""Loading a task from the config (``[task] factory = "package.module:function"``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from runner._plugins import call_factory, resolve_callable
from runner.tasks._protocol import (
    HasCleanup,
    HasDemonstrations,
    HasEvalProblems,
    HasGroupRewards,
    HasMaxPromptTokens,
    Task,
)

_REQUIRED = ("stop_token_ids", "max_turns", "max_tokens_per_turn", "problems", "make_env")


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedTask:
    """A task checked once when it is loaded, with its optional methods probed.

    Attributes:
      name: the factory reference (``"runner.tasks.calc:make_task"``), for messages.
      task: the task object.
      vocab_size: the configured tokenizer's (environment tokens must be below it).
      stop_token_ids, max_turns, max_tokens_per_turn: the task's, validated.
      has_eval_problems, has_demonstrations, has_max_prompt_tokens: its optional methods.
    """

    name: str
    task: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    max_turns: int
    max_tokens_per_turn: int
    has_eval_problems: bool
    has_demonstrations: bool
    has_max_prompt_tokens: bool
    has_group_rewards: bool = False
    has_cleanup: bool = False

    def cleanup(self) -> None:
        """The task's ``cleanup()`` hook, if it has one (once, when the run ends)."""
        if self.has_cleanup:
            from runner.tasks._rollout import resolve

            resolve(self.task.cleanup())

    def problems(self, rng: np.random.Generator, n: int) -> list[Any]:
        """``task.problems(rng, n)``, checked to be a list of ``n`` problems."""
        out = self.task.problems(rng, n)
        if not isinstance(out, list | tuple) or len(out) != n:
            got = f"{len(out)} items" if isinstance(out, list | tuple) else type(out).__name__
            raise ValueError(f"task {self.name}: problems(rng, {n}) returned {got}, expected {n}")
        return list(out)

    def eval_problems(self) -> list[Any]:
        out = self.task.eval_problems()
        if not isinstance(out, list | tuple) or not out:
            raise ValueError(f"task {self.name}: eval_problems() must return a non-empty list")
        return list(out)

    def demonstrations(self, rng: np.random.Generator, n: int) -> list[Any]:
        out = self.task.demonstrations(rng, n)
        if not isinstance(out, list | tuple) or len(out) != n:
            got = f"{len(out)} items" if isinstance(out, list | tuple) else type(out).__name__
            raise ValueError(
                f"task {self.name}: demonstrations(rng, {n}) returned {got}, expected {n} records"
            )
        return list(out)

    def max_prompt_tokens(self) -> int:
        value = self.task.max_prompt_tokens()
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(
                f"task {self.name}: max_prompt_tokens() must be an int >= 1, got {value!r}"
            )
        return int(value)


def _positive_int(name: str, attr: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"task {name}: {attr} must be an int >= 1, got {value!r}")
    return int(value)


def check_task(name: str, task: Any, vocab_size: int) -> LoadedTask:
    """Checks the shape of a task object (`runner.tasks.Task`) once.

    Raises:
      ValueError: naming the task and the missing or invalid member.
    """
    missing = [m for m in _REQUIRED if not hasattr(task, m)]
    if missing:
        raise ValueError(
            f"task {name}: the factory returned a {type(task).__name__} without {missing}; a task "
            f"has {', '.join(_REQUIRED)} (runner.tasks.Task)"
        )
    if not isinstance(task, Task):
        raise ValueError(f"task {name}: {type(task).__name__} is not a runner.tasks.Task")
    for method in ("problems", "make_env"):
        if not callable(getattr(task, method)):
            raise ValueError(f"task {name}: {method} must be a method")
    raw = task.stop_token_ids
    try:
        stops = tuple(raw)
    except TypeError:
        raise ValueError(
            f"task {name}: stop_token_ids must be a sequence of token ids, got {raw!r}"
        ) from None
    if not stops:
        raise ValueError(f"task {name}: stop_token_ids is empty (a policy turn must end)")
    for t in stops:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab_size:
            raise ValueError(
                f"task {name}: stop token {t!r} is not a token id in [0, {vocab_size}) (the "
                "configured tokenizer's vocabulary)"
            )
    return LoadedTask(
        name=name,
        task=task,
        vocab_size=vocab_size,
        stop_token_ids=tuple(int(t) for t in stops),
        max_turns=_positive_int(name, "max_turns", task.max_turns),
        max_tokens_per_turn=_positive_int(name, "max_tokens_per_turn", task.max_tokens_per_turn),
        has_eval_problems=isinstance(task, HasEvalProblems),
        has_demonstrations=isinstance(task, HasDemonstrations),
        has_max_prompt_tokens=isinstance(task, HasMaxPromptTokens),
        has_group_rewards=isinstance(task, HasGroupRewards),
        has_cleanup=isinstance(task, HasCleanup),
    )


def load_task(factory: str, kwargs: Mapping[str, Any], tokenizer: Any) -> LoadedTask:
    """Imports ``factory``, calls it as ``function(tokenizer=tokenizer, **kwargs)`` and checks
    the result (`check_task`).

    Raises:
      ValueError: naming ``[task].factory`` and what failed (import, the call, the shape).
    """
    fn = resolve_callable(factory, "[task].factory")
    if "tokenizer" in kwargs:
        raise ValueError("config [task.kwargs]: 'tokenizer' is passed by the runner")
    task = call_factory(fn, factory, "[task].factory", tokenizer=tokenizer, **dict(kwargs))
    return check_task(factory, task, tokenizer.vocab_size)
