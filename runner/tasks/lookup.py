"""A multi-turn key-value lookup task whose observations the policy needs.

The prompt holds a small table of keys (letters) whose values are digits or other keys, and asks
for the value reached by following links from a start key::

    <bos>a=c,b=4,c=7,d=b,e=1,f=e\\nQ: a\\n

The policy may query one key per turn with the tool (``get <key>\\n``; the environment answers
``= <value>\\n``, the value being the observation target, or ``= ?\\n`` for an unknown key) and
ends with ``ans <digit>\\n`` (reward 1.0 iff it is the digit at the end of the chain; anything
malformed ends the episode with 0.0). A chain has ``hops`` links (``a → c → 7`` is 2 hops).

**Why predicting the observations should help here.** The turn budget is ``max_turns = hops`` by
default: one turn short of querying every link and then answering. The policy must resolve the
last link itself, by reading the table in its prompt — an in-context lookup of ``key → value``.
Every observation is exactly such a lookup (the value of the queried key, a copy from the table
that the prompt holds), so ECHO's observation loss trains the very computation the policy has to
perform unaided to answer, on every tool call of every episode, correct or not. The calculator is
the contrast: there the answer can be copied from the last observation, and the skill that
predicting observations teaches (arithmetic) is one the policy never needs. Whether the gain shows
at this scale is what ``benchmarks/echo_study.py`` measures.

``[task] factory = "runner.tasks.lookup:make_task"`` with ``[task.kwargs]`` ``num_keys`` (table
size, 2-26), ``hops`` (≥ 1), ``max_turns`` (default ``hops``), ``max_tokens_per_turn`` (8),
``eval_seed`` (the fixed held-out problems, ``num_eval`` of them, 64), ``latency_ms`` and
``async_env`` (an emulated tool latency per step, `runner.tasks._latency`). Works with any tokenizer
that encodes a newline as one token (its turns end there); with the built-in one, tokens are
characters.
"""

from __future__ import annotations

import dataclasses
import re
import string
from typing import Any

import numpy as np

from runner.tasks._latency import check_latency, with_latency
from runner.tasks._protocol import StepResult
from runner.tokenizers import Tokenizer

UNKNOWN = "?"
_GET_RE = re.compile(r"get ([a-z])")
_ANS_RE = re.compile(r"ans ([0-9])")


@dataclasses.dataclass(frozen=True)
class Lookup:
    """A table (``values[i]`` is the value of key ``keys[i]``), the start key and the answer."""

    keys: tuple[str, ...]
    values: tuple[str, ...]
    start: str
    answer: str
    chain: tuple[str, ...]  # the keys from start to the last link

    @property
    def table(self) -> str:
        return ",".join(f"{k}={v}" for k, v in zip(self.keys, self.values, strict=True))

    def value(self, key: str) -> str:
        return self.values[self.keys.index(key)] if key in self.keys else UNKNOWN


def sample_lookup(rng: np.random.Generator, num_keys: int, hops: int) -> Lookup:
    """A random table with a chain of ``hops`` links from a random start key to a digit."""
    keys = tuple(string.ascii_lowercase[:num_keys])
    chain = [keys[int(i)] for i in rng.permutation(num_keys)[:hops]]
    answer = str(int(rng.integers(10)))
    values = {}
    for here, there in zip(chain, chain[1:] + [answer], strict=True):
        values[here] = there
    for k in keys:
        if k not in values:  # distractors: a digit or another key
            values[k] = (
                str(int(rng.integers(10)))
                if rng.random() < 0.5
                else keys[int(rng.integers(num_keys))]
            )
    return Lookup(keys, tuple(values[k] for k in keys), chain[0], answer, tuple(chain))


class LookupEnv:
    """One episode of a lookup problem."""

    def __init__(self, task: LookupTask, problem: Lookup):
        self.task, self.problem, self.turn = task, problem, 0

    def initial_observation(self) -> list[int]:
        return self.task.prompt(self.problem)

    def step(self, action: list[int]) -> StepResult:
        text = self.task.tokenizer.decode(action)
        self.turn += 1
        if not text.endswith("\n") or "\n" in text[:-1]:
            return StepResult(0.0, True, metrics={"malformed": 1.0})
        line = text[:-1]
        m = _ANS_RE.fullmatch(line)
        if m is not None:
            r = float(m.group(1) == self.problem.answer)
            return StepResult(r, True, metrics={"correct": r, "answered": 1.0})
        m = _GET_RE.fullmatch(line)
        if m is None:
            return StepResult(0.0, True, metrics={"malformed": 1.0})
        if self.turn >= self.task.max_turns:  # no observation follows the last turn
            return StepResult(0.0, True, metrics={"queries": 1.0})
        body = self.problem.value(m.group(1))
        tokens, targets = self.task.message(body)
        return StepResult(0.0, False, tokens, targets, metrics={"queries": 1.0})


class LookupTask:
    """Key-value lookups with a ``get`` tool (module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        num_keys: int,
        hops: int,
        max_turns: int,
        max_tokens_per_turn: int,
        eval_seed: int,
        num_eval: int,
        latency_ms: float = 0.0,
        async_env: bool = False,
    ):
        self.latency_ms, self.async_env = check_latency(latency_ms, async_env)
        self.tokenizer = tokenizer
        self.num_keys, self.hops = num_keys, hops
        self.max_turns, self.max_tokens_per_turn = max_turns, max_tokens_per_turn
        newline = tokenizer.encode("\n")
        if len(newline) != 1:
            raise ValueError(
                f"the lookup task needs a tokenizer that encodes a newline as one token; "
                f"{tokenizer!r} gives {newline}"
            )
        self.stop_token_ids = tuple(newline) + (
            (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
        )
        rng = np.random.default_rng([eval_seed, 7])
        self._eval = [sample_lookup(rng, num_keys, hops) for _ in range(num_eval)]

    def problems(self, rng: np.random.Generator, n: int) -> list[Lookup]:
        return [sample_lookup(rng, self.num_keys, self.hops) for _ in range(n)]

    def eval_problems(self) -> list[Lookup]:
        return list(self._eval)

    def make_env(self, problem: Lookup) -> Any:
        return with_latency(LookupEnv(self, problem), self.latency_ms, self.async_env)

    def prompt(self, problem: Lookup) -> list[int]:
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return bos + self.tokenizer.encode(f"{problem.table}\nQ: {problem.start}\n")

    def message(self, body: str) -> tuple[list[int], list[bool]]:
        """``= <body>\\n`` and its target flags (the body only)."""
        pre, mid, post = (self.tokenizer.encode(t) for t in ("= ", body, "\n"))
        return pre + mid + post, [False] * len(pre) + [True] * len(mid) + [False] * len(post)

    def max_prompt_tokens(self) -> int:
        probe = Lookup(
            tuple(string.ascii_lowercase[: self.num_keys]),
            ("0",) * self.num_keys,
            "a",
            "0",
            ("a",),
        )
        return len(self.prompt(probe))

    def expert_actions(self, problem: Lookup) -> list[str]:
        """Tool calls for the first links the turn budget allows, then the answer (the
        remaining links resolved from the table)."""
        calls = min(len(problem.chain), self.max_turns - 1)
        return [f"get {k}\n" for k in problem.chain[:calls]] + [f"ans {problem.answer}\n"]

    def demonstrations(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        """The expert's episodes as chat records (the loss on its actions)."""
        out = []
        for problem in self.problems(rng, n):
            messages = [{"role": "user", "content": f"{problem.table}\nQ: {problem.start}\n"}]
            for line in self.expert_actions(problem):
                messages.append({"role": "assistant", "content": line})
                m = _GET_RE.fullmatch(line[:-1])
                if m is not None:
                    messages.append({"role": "tool", "content": f"= {problem.value(m.group(1))}\n"})
            out.append({"messages": messages})
        return out


def make_task(
    *,
    tokenizer: Tokenizer,
    num_keys: int = 6,
    hops: int = 2,
    max_turns: int | None = None,
    max_tokens_per_turn: int = 8,
    eval_seed: int = 1234,
    num_eval: int = 64,
    latency_ms: float = 0.0,
    async_env: bool = False,
) -> LookupTask:
    """``[task] factory`` for `LookupTask`.

    Raises:
      ValueError: naming the bad ``[task.kwargs]`` value.
    """
    max_turns = hops if max_turns is None else max_turns
    for key, value, low in (
        ("num_keys", num_keys, 2),
        ("hops", hops, 1),
        ("max_turns", max_turns, 1),
        ("max_tokens_per_turn", max_tokens_per_turn, 6),
        ("num_eval", num_eval, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"[task.kwargs].{key} must be an int >= {low}, got {value!r}")
    if num_keys > 26 or hops > num_keys:
        raise ValueError(
            f"[task.kwargs]: need hops <= num_keys <= 26, got num_keys={num_keys}, hops={hops}"
        )
    return LookupTask(
        tokenizer,
        num_keys=num_keys,
        hops=hops,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        eval_seed=int(eval_seed),
        num_eval=num_eval,
        latency_ms=latency_ms,
        async_env=async_env,
    )
