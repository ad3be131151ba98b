"""The calculator-tool task (`runner.env.calc`) behind the task protocol — the default task.

``[task] factory = "runner.tasks.calc:make_task"`` with ``[task.kwargs]`` ``max_operand``,
``num_ops``, ``max_turns``, ``max_tokens_per_turn`` (and ``latency_ms``, ``async_env``: an
emulated tool latency, `runner.tasks._latency`). Problems, prompts, observations, rewards and
the scripted expert are `runner.env.calc`'s, unchanged: through `runner.tasks.rollout` the main
job samples, rewards and trains exactly as the calculator's own rollout loop did (the tests
compare both). Observation targets are the bodies of the ``= <body>\\n`` messages (docs/echo.md#observation-masks).
Demonstrations are the expert's episodes as chat records (user: the question; assistant: each
action; tool: each observation), which the character tokenizer renders back to the expert's tokens
with the loss on the actions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runner.env import calc
from runner.env import tokenizer as tok
from runner.tasks._latency import check_latency, with_latency
from runner.tasks._protocol import StepResult
from runner.tokenizers import CharTokenizer, Tokenizer


class CalcEpisodeEnv:
    """One episode of a calculator problem (`runner.tasks.Env`)."""

    def __init__(self, env: calc.CalcEnv, problem: calc.Problem):
        self.env, self.problem, self.turn = env, problem, 0

    def initial_observation(self) -> list[int]:
        return self.env.prompt_tokens(self.problem).tolist()

    def step(self, action: list[int]) -> StepResult:
        result = self.env.respond(self.problem, tok.decode(action), self.turn)
        self.turn += 1
        metrics = {f"outcome/{result.outcome}": 1.0} if result.done else {}
        if result.observation is None:
            return StepResult(reward=result.reward, done=result.done, metrics=metrics)
        obs = result.observation
        return StepResult(
            reward=result.reward,
            done=result.done,
            observation=obs.tokens.tolist(),
            observation_targets=(obs.body_mask > 0).tolist(),
            metrics=metrics,
        )


class CalcTask:
    """Arithmetic with a ``calc`` tool (`runner.env.calc`), as a `runner.tasks.Task`.

    Args:
      max_operand, num_ops, max_turns: `runner.env.calc.CalcEnv`'s.
      max_tokens_per_turn: the token limit of one policy turn.
      latency_ms, async_env: an emulated tool latency per ``step`` (`runner.tasks._latency`).
    """

    stop_token_ids = calc.STOP_TOKEN_IDS

    def __init__(
        self,
        *,
        max_operand: int = 9,
        num_ops: int = 1,
        max_turns: int = 4,
        max_tokens_per_turn: int = 12,
        latency_ms: float = 0.0,
        async_env: bool = False,
    ):
        self.latency_ms, self.async_env = check_latency(latency_ms, async_env)
        for key, value in (
            ("max_operand", max_operand),
            ("num_ops", num_ops),
            ("max_turns", max_turns),
            ("max_tokens_per_turn", max_tokens_per_turn),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"[task.kwargs].{key} must be an integer > 0, got {value!r}")
        self.env = calc.CalcEnv(max_operand=max_operand, num_ops=num_ops, max_turns=max_turns)
        self.max_turns = max_turns
        self.max_tokens_per_turn = max_tokens_per_turn

    def problems(self, rng: np.random.Generator, n: int) -> list[calc.Problem]:
        return [self.env.sample_problem(rng) for _ in range(n)]

    def make_env(self, problem: calc.Problem) -> Any:
        return with_latency(CalcEpisodeEnv(self.env, problem), self.latency_ms, self.async_env)

    def max_prompt_tokens(self) -> int:
        return self.env.max_prompt_tokens()

    def demonstrations(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        """``n`` expert episodes as chat records (problems drawn with ``rng``)."""
        return [self.record(self.env.sample_problem(rng)) for _ in range(n)]

    def record(self, problem: calc.Problem) -> dict[str, Any]:
        """The expert's episode of ``problem`` as a ``{"messages": [...]}`` record."""
        traj = calc.expert_trajectory(self.env, problem)
        prompt = tok.decode(traj.segments[0].tokens[1:])  # without BOS: the renderer adds it
        messages = [{"role": "user", "content": prompt}]
        for seg in traj.segments[1:]:
            role = "assistant" if seg.kind == "action" else "tool"
            messages.append({"role": role, "content": tok.decode(seg.tokens)})
        return {"messages": messages}


def make_task(*, tokenizer: Tokenizer, **kwargs: Any) -> CalcTask:
    """``[task] factory`` for the calculator (``kwargs``: `CalcTask`'s).

    Raises:
      ValueError: a tokenizer other than the built-in character tokenizer (the calculator's
        prompts, tool messages and parser are written in its vocabulary).
    """
    if not isinstance(tokenizer, CharTokenizer):
        raise ValueError(
            'the calculator task needs the built-in character tokenizer ([tokenizer].path = ""), '
            f"got {tokenizer!r}"
        )
    return CalcTask(**kwargs)
