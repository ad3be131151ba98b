"""A single-turn question-answer task read from JSONL — RL on a user's question set, no code.

``[task] factory = "runner.tasks.qa:make_task"`` with ``[task.kwargs]``:

* ``path``: JSONL of ``{"prompt": "...", "answer": "..."}`` (other keys ignored);
* ``reward``: ``"exact"`` (the completion, stripped, equals the answer, stripped),
  ``"numeric"`` (the last number in the completion is within ``tolerance`` × max(1, |answer|) of
  the answer, which must be a number) or ``"regex"`` (the stripped completion fully matches the
  answer, a regular expression);
* ``eval_path``: a held-out JSONL of the same form (``eval_problems()``; without it the runner
  draws its evaluation problems from ``path``);
* ``system``: an optional system message before each prompt;
* ``max_tokens_per_turn`` (default 32); ``completion_suffix``: appended to the answer in the SFT
  demonstrations (default ``"\\n"`` without a chat template — the character tokenizer's turns end
  at a newline — and ``""`` with one, whose end-of-turn token ends the turn).

The prompt is the user message rendered with the tokenizer's renderer (`runner.chat`) and the
assistant's turn opening; the policy's turn stops at the tokenizer's ``stop_token_ids``; the
episode is one turn. ``demonstrations()`` (for ``exact`` and ``numeric``) are the records as
prompt/completion pairs, so ``[sft].steps`` warms the policy up on the answers. Every record is
checked when the task is built, with errors naming the file, the line and the field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from runner._json import JsonError
from runner._json import loads as strict_json
from runner.chat import renderer_for
from runner.tasks._protocol import StepResult
from runner.tokenizers import Tokenizer

REWARDS = ("exact", "numeric", "regex")
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Question:
    """One record: its prompt tokens, the answer and where it came from."""

    where: str
    prompt: str
    answer: str
    tokens: tuple[int, ...]


def _score(kind: str, text: str, answer: str, tolerance: float) -> float:
    if kind == "exact":
        return float(text.strip() == answer.strip())
    if kind == "numeric":
        found = _NUMBER_RE.findall(text)
        if not found:
            return 0.0
        value, target = float(found[-1]), float(answer)
        return float(abs(value - target) <= tolerance * max(1.0, abs(target)))
    return float(re.fullmatch(answer, text.strip(), flags=re.DOTALL) is not None)


def read_questions(
    path: str, key: str, tokenizer: Tokenizer, *, reward: str, system: str
) -> list[Question]:
    """Reads and checks a question file.

    Raises:
      ValueError: ``"<file>:<line>: <field> <rule>"``; a missing or empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"[task.kwargs].{key}: file not found: {path}")
    renderer = renderer_for(tokenizer)
    out = []
    for number, line in enumerate(p.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = strict_json(line, first=number == 1)
        except JsonError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
        prompt, answer = obj.get("prompt"), obj.get("answer")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: prompt must be a non-empty string, got {prompt!r}")
        if reward == "numeric" and isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = repr(answer)
        if not isinstance(answer, str):
            raise ValueError(f"{where}: answer must be a string, got {answer!r}")
        if reward == "numeric":
            try:
                ok = math.isfinite(float(answer))
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{where}: answer must be a finite number (reward = 'numeric'), got {answer!r}"
                )
        if reward == "regex":
            try:
                re.compile(answer)
            except re.error as exc:
                raise ValueError(
                    f"{where}: answer is not a valid regular expression ({exc})"
                ) from None
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        try:
            tokens = renderer.prompt(messages)
        except ValueError as exc:
            raise ValueError(f"{where}: prompt: {getattr(exc, 'detail', exc)}") from None
        out.append(Question(where, prompt, answer, tuple(tokens)))
    if not out:
        raise ValueError(f"[task.kwargs].{key}: {path} holds no records")
    return out


class QAEnv:
    """One single-turn episode."""

    def __init__(self, task: QATask, question: Question):
        self.task, self.question = task, question

    def initial_observation(self) -> list[int]:
        return list(self.question.tokens)

    def step(self, action: list[int]) -> StepResult:
        ids = action[:-1] if action and action[-1] in self.task.stop_token_ids else action
        text = self.task.tokenizer.decode(ids)
        r = _score(self.task.reward, text, self.question.answer, self.task.tolerance)
        return StepResult(reward=r, done=True, metrics={"correct": r})


class QATask:
    """Questions from a JSONL file, one turn each (module docstring)."""

    max_turns = 1

    def __init__(
        self,
        tokenizer: Tokenizer,
        questions: list[Question],
        *,
        reward: str,
        tolerance: float,
        max_tokens_per_turn: int,
        system: str,
        completion_suffix: str,
    ):
        self.tokenizer, self.questions = tokenizer, questions
        self.reward, self.tolerance, self.system = reward, tolerance, system
        self.max_tokens_per_turn = max_tokens_per_turn
        self.completion_suffix = completion_suffix
        self.stop_token_ids = tuple(tokenizer.stop_token_ids)

    def problems(self, rng: np.random.Generator, n: int) -> list[Question]:
        return [self.questions[int(i)] for i in rng.integers(0, len(self.questions), size=n)]

    def make_env(self, problem: Question) -> QAEnv:
        return QAEnv(self, problem)

    def max_prompt_tokens(self) -> int:
        return max(len(q.tokens) for q in self.questions)


class _Demonstrations:
    def demonstrations(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        """The records as chat records (the answer as the assistant's completion)."""
        out = []
        for q in self.problems(rng, n):
            messages = [{"role": "system", "content": self.system}] if self.system else []
            messages += [
                {"role": "user", "content": q.prompt},
                {"role": "assistant", "content": q.answer + self.completion_suffix},
            ]
            out.append({"messages": messages})
        return out


class _HeldOut:
    def eval_problems(self) -> list[Question]:
        return list(self.held_out)


def make_task(
    *,
    tokenizer: Tokenizer,
    path: str,
    reward: str = "exact",
    eval_path: str = "",
    tolerance: float = 1e-6,
    max_tokens_per_turn: int = 32,
    system: str = "",
    completion_suffix: str | None = None,
) -> QATask:
    """``[task] factory`` for `QATask` (module docstring for the arguments).

    Raises:
      ValueError: a bad argument, or the first bad record (file, line, field).
    """
    if reward not in REWARDS:
        raise ValueError(f"[task.kwargs].reward must be one of {REWARDS}, got {reward!r}")
    if (
        isinstance(max_tokens_per_turn, bool)
        or not isinstance(max_tokens_per_turn, int)
        or max_tokens_per_turn < 1
    ):
        raise ValueError(
            f"[task.kwargs].max_tokens_per_turn must be an int >= 1, got {max_tokens_per_turn!r}"
        )
    if not (isinstance(tolerance, int | float) and tolerance >= 0):
        raise ValueError(f"[task.kwargs].tolerance must be a number >= 0, got {tolerance!r}")
    if not tokenizer.stop_token_ids:
        raise ValueError(
            f"the QA task needs a tokenizer with stop tokens (an eos_token); {tokenizer!r} has none"
        )
    if completion_suffix is None:
        completion_suffix = "\n" if tokenizer.chat_template is None else ""
    questions = read_questions(path, "path", tokenizer, reward=reward, system=system)
    bases: list[type] = [QATask]
    if reward != "regex":  # a regex answer is no completion to imitate
        bases.insert(0, _Demonstrations)
    held_out = None
    if eval_path:
        held_out = read_questions(eval_path, "eval_path", tokenizer, reward=reward, system=system)
        bases.insert(0, _HeldOut)
    cls = type("QATask", tuple(bases), {}) if len(bases) > 1 else QATask
    task = cls(
        tokenizer,
        questions,
        reward=reward,
        tolerance=float(tolerance),
        max_tokens_per_turn=max_tokens_per_turn,
        system=system,
        completion_suffix=completion_suffix,
    )
    task.held_out = held_out
    return task
