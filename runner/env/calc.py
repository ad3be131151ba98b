"""A multi-turn calculator-tool environment whose observations are learnable.

Text protocol (character-level, `runner.env.tokenizer`):

* **Prompt** (environment, never a loss target): ``<bos>Q: 48*2+7\\n``.
* **Action turn** (policy, ends at a newline): either a tool call ``calc <expr>\\n`` or the final
  answer ``ans <int>\\n``. ``<expr>`` is integers (an optional leading ``-``, at most 12 digits)
  joined by ``+ - *`` with the usual precedence and no spaces. Anything else is answered with an
  error message.
* **Observation** (environment) after every non-final action: ``= <body>\\n``. The *body* is the
  result (``96``) or an error (``error: bad expression``, ``error: unknown command``,
  ``error: result too large``). ``"= "`` and ``"\\n"`` are formatting wrappers: only the body is an
  observation target (the paper's O′, docs/echo.md#observation-masks). The body is a deterministic function
  of the action text alone, hence of the history: predicting it is learnable.
* **End**: the episode ends after an answer line (``ans``/``ans ...``), after a turn that does not
  end in a newline (EOS or the per-turn token limit), or after ``max_turns`` actions; no
  observation follows the last action (`rollout` may also end an episode that would outgrow the
  trainer's ``max_seq_len``: outcome ``context_limit``). Reward 1.0 iff the answer line is exactly
  ``ans <int>\\n`` (``-?(0|[1-9][0-9]*)``) and the integer is the problem's value, else 0.0.

Example trajectory for ``48*2+7``, with its target-aligned masks (``A`` = ``action_mask``,
``O`` = ``obs_mask``; the prompt, ``"= "`` and the observation's newline are in neither)::

    <bos>Q: 48*2+7\\n calc 48*2\\n = 96\\n calc 96+7\\n = 103\\n ans 103\\n
          (prompt)      AAAAAAAAAA   OO     AAAAAAAAAA   OOO    AAAAAAAA

Pieces: `CalcEnv` (problems, prompts, the pure `CalcEnv.respond`), `Trajectory` (one episode:
segments of prompt / action / observation tokens), `trajectory_to_seq` (to a `runner.Seq` with
``action_mask``, ``obs_mask``, ``sampling_logprobs``), the scripted expert
(`expert_actions`, `expert_trajectory`, `expert_sft_example`) and `rollout`, the multi-turn
sampling loop against any object with the `runner.Trainer` ``sample`` method.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from runner._seeds import call_seed
from runner._types import Seq, make_seq
from runner.env import tokenizer as tok

OPERATORS = "+-*"
#: Observation bodies for malformed actions.
ERR_EXPRESSION = "error: bad expression"
ERR_COMMAND = "error: unknown command"
ERR_TOO_LARGE = "error: result too large"
#: Formatting wrappers around an observation body (not observation targets).
OBS_PREFIX = "= "
OBS_SUFFIX = "\n"
#: Results with ``abs(value) >= RESULT_LIMIT`` are answered with `ERR_TOO_LARGE`.
RESULT_LIMIT = 10**12
_MAX_DIGITS = 12  # any result the calculator returns can be fed back to it
#: The token ids a policy turn stops at (the stop token is part of the action).
STOP_TOKEN_IDS = (tok.NEWLINE_ID, tok.EOS_ID)

_ANSWER_RE = re.compile(r"ans (-?(?:0|[1-9][0-9]*))")

# Outcomes (``StepResult.outcome`` / ``Trajectory.outcome``).
CONTINUE = "continue"  # an observation follows
CORRECT = "correct"
WRONG_ANSWER = "wrong_answer"
MALFORMED_ANSWER = "malformed_answer"
MAX_TURNS = "max_turns"
UNTERMINATED = "unterminated"  # the turn ended without a newline (EOS or token limit)
CONTEXT_LIMIT = "context_limit"  # `rollout`: the next turn would not fit in max_seq_len


class CalcError(ValueError):
    """A calculator expression that cannot be evaluated; ``body`` is the observation body."""

    def __init__(self, body: str):
        super().__init__(body)
        self.body = body


def evaluate(expr: str) -> int:
    """Evaluates ``expr`` safely (no ``eval``): integers and ``+ - *``, ``*`` binding tighter.

    Grammar: ``expr := num (op num)*``, ``num := -?[0-9]{1,12}``, ``op := + | - | *``; no spaces.
    Evaluation is left to right within each precedence level.

    Args:
      expr: the expression text.

    Returns:
      int value.

    Raises:
      CalcError: with body `ERR_EXPRESSION` (unparsable) or `ERR_TOO_LARGE` (|value| or an
        intermediate product ≥ `RESULT_LIMIT`).
    """
    nums: list[int] = []
    ops: list[str] = []
    pos, n = 0, len(expr)
    while True:
        start = pos
        if pos < n and expr[pos] == "-":
            pos += 1
        digits = pos
        while pos < n and "0" <= expr[pos] <= "9" and pos - digits < _MAX_DIGITS + 1:
            pos += 1
        if pos == digits or pos - digits > _MAX_DIGITS:
            raise CalcError(ERR_EXPRESSION)
        nums.append(int(expr[start:pos]))
        if pos == n:
            break
        if expr[pos] not in OPERATORS:
            raise CalcError(ERR_EXPRESSION)
        ops.append(expr[pos])
        pos += 1
    # Fold the products first, then the sums, left to right.
    terms, signs = [nums[0]], []
    for op, x in zip(ops, nums[1:], strict=True):
        if op == "*":
            terms[-1] *= x
            if abs(terms[-1]) >= RESULT_LIMIT:
                raise CalcError(ERR_TOO_LARGE)
        else:
            terms.append(x)
            signs.append(op)
    value = terms[0]
    for op, x in zip(signs, terms[1:], strict=True):
        value = value + x if op == "+" else value - x
    if abs(value) >= RESULT_LIMIT:
        raise CalcError(ERR_TOO_LARGE)
    return value


@dataclasses.dataclass(frozen=True)
class Problem:
    """An arithmetic problem: ``operands[0] ops[0] operands[1] ...`` and its value."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.operands) != len(self.ops) + 1 or not self.operands:
            raise ValueError(
                f"Problem needs len(operands) == len(ops) + 1 >= 1, got {len(self.operands)} "
                f"operands and {len(self.ops)} ops"
            )
        if any(op not in OPERATORS for op in self.ops):
            raise ValueError(f"Problem ops must be in {OPERATORS!r}, got {self.ops}")
        if any(x < 0 for x in self.operands):
            raise ValueError(f"Problem operands must be non-negative, got {self.operands}")

    @property
    def expression(self) -> str:
        parts = [str(self.operands[0])]
        for op, x in zip(self.ops, self.operands[1:], strict=True):
            parts += [op, str(x)]
        return "".join(parts)

    @property
    def answer(self) -> int:
        return evaluate(self.expression)

    @classmethod
    def parse(cls, expression: str) -> Problem:
        """The problem of an expression like ``"48*2+7"`` (non-negative operands)."""
        parts = re.split(r"([+\-*])", expression)
        try:
            operands = tuple(int(p) for p in parts[0::2])
        except ValueError as exc:
            raise ValueError(f"not a problem expression: {expression!r}") from exc
        return cls(operands, tuple(parts[1::2]))


@dataclasses.dataclass(frozen=True)
class Observation:
    """An environment message: ``tokens`` = prefix + body + suffix; ``body_mask`` marks the body.

    Attributes:
      body: the message body (the observation target text).
      tokens: int64[n] rendered tokens (``"= " + body + "\\n"``).
      body_mask: float64[n], 1.0 on the body's tokens, 0.0 on the wrappers.
    """

    body: str
    tokens: np.ndarray
    body_mask: np.ndarray

    @classmethod
    def render(cls, body: str) -> Observation:
        pre, mid, post = tok.encode(OBS_PREFIX), tok.encode(body), tok.encode(OBS_SUFFIX)
        tokens = np.asarray(pre + mid + post, dtype=np.int64)
        mask = np.concatenate([np.zeros(len(pre)), np.ones(len(mid)), np.zeros(len(post))])
        return cls(body, tokens, mask)

    @property
    def text(self) -> str:
        return tok.decode(self.tokens)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action.

    Attributes:
      observation: the message to append (None when ``done``).
      done: the episode is over.
      reward: 1.0 for a correct well-formed answer, else 0.0.
      outcome: one of ``continue``, ``correct``, ``wrong_answer``, ``malformed_answer``,
        ``max_turns``, ``unterminated``.
    """

    observation: Observation | None
    done: bool
    reward: float
    outcome: str


class CalcEnv:
    """Arithmetic problems answered with the help of a ``calc`` tool (module docstring).

    Args:
      seed: seeds `CalcEnv.problem` (problem ``i`` is a fixed function of ``(seed, i)``).
      max_operand: operands are drawn uniformly from ``[min_operand, max_operand]``.
      num_ops: number of operations per problem: an int, or an inclusive ``(low, high)`` range.
      max_turns: most policy turns per episode (default: the largest ``num_ops`` + 2, enough for
        the step-by-step expert plus one spare turn).
      min_operand: see ``max_operand`` (≥ 0).
      operators: the operators problems use (a non-empty subset of ``"+-*"``).
    """

    def __init__(
        self,
        seed: int = 0,
        max_operand: int = 9,
        num_ops: int | tuple[int, int] = 1,
        max_turns: int | None = None,
        *,
        min_operand: int = 0,
        operators: str = OPERATORS,
    ):
        lo, hi = (num_ops, num_ops) if isinstance(num_ops, int) else tuple(num_ops)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"CalcEnv.num_ops must be an int ≥ 1 or a range (lo, hi), got {num_ops}"
            )
        if not (isinstance(min_operand, int) and 0 <= min_operand <= max_operand):
            raise ValueError(
                f"CalcEnv needs 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}"
            )
        if not operators or any(op not in OPERATORS for op in operators):
            raise ValueError(f"CalcEnv.operators must be a subset of {OPERATORS!r}: {operators!r}")
        largest = max_operand ** (hi + 1) if "*" in operators else (hi + 1) * max_operand
        if largest >= RESULT_LIMIT:
            raise ValueError(
                f"CalcEnv: max_operand={max_operand} with up to {hi} operations can exceed the "
                f"calculator's limit {RESULT_LIMIT:.0e}"
            )
        max_turns = hi + 2 if max_turns is None else max_turns
        if not (isinstance(max_turns, int) and max_turns >= 1):
            raise ValueError(f"CalcEnv.max_turns must be an int ≥ 1, got {max_turns}")
        self.seed = int(seed)
        self.min_operand, self.max_operand = int(min_operand), int(max_operand)
        self.num_ops = (lo, hi)
        self.max_turns = max_turns
        self.operators = operators

    def __repr__(self) -> str:
        return (
            f"CalcEnv(seed={self.seed}, operands=[{self.min_operand}, {self.max_operand}], "
            f"num_ops={self.num_ops}, max_turns={self.max_turns}, operators={self.operators!r})"
        )

    # -- problems ---------------------------------------------------------------------------------

    def sample_problem(self, rng: np.random.Generator) -> Problem:
        """A random problem drawn with ``rng``."""
        k = int(rng.integers(self.num_ops[0], self.num_ops[1] + 1))
        operands = rng.integers(self.min_operand, self.max_operand + 1, size=k + 1)
        ops = rng.choice(list(self.operators), size=k)
        return Problem(tuple(int(x) for x in operands), tuple(str(o) for o in ops))

    def problem(self, index: int) -> Problem:
        """Problem number ``index``: a deterministic function of ``(seed, index)``."""
        return self.sample_problem(np.random.default_rng([self.seed, int(index)]))

    def problems(self, start: int, count: int) -> list[Problem]:
        """``[problem(start), ..., problem(start + count - 1)]``."""
        return [self.problem(i) for i in range(start, start + count)]

    # -- protocol ---------------------------------------------------------------------------------

    def prompt_tokens(self, problem: Problem) -> np.ndarray:
        """``<bos>Q: <expression>\\n`` as int64 ids."""
        return np.asarray(tok.encode(f"Q: {problem.expression}\n", add_bos=True), dtype=np.int64)

    def respond(self, problem: Problem, action: str, turn: int) -> StepResult:
        """The environment's answer to action number ``turn`` (0-based) — a pure function.

        The observation body depends on the action text only; ``problem`` decides the reward and
        ``turn`` the turn limit.

        Args:
          problem: the episode's problem.
          action: the decoded action turn, including its final newline when it has one.
          turn: how many actions came before this one.

        Returns:
          `StepResult`.
        """
        if not action.endswith("\n") or "\n" in action[:-1]:
            return StepResult(None, True, 0.0, UNTERMINATED)
        line = action[:-1]
        if line == "ans" or line.startswith("ans "):
            m = _ANSWER_RE.fullmatch(line)
            if m is None:
                return StepResult(None, True, 0.0, MALFORMED_ANSWER)
            if int(m.group(1)) == problem.answer:
                return StepResult(None, True, 1.0, CORRECT)
            return StepResult(None, True, 0.0, WRONG_ANSWER)
        if turn + 1 >= self.max_turns:
            return StepResult(None, True, 0.0, MAX_TURNS)
        return StepResult(Observation.render(tool_output(line)), False, 0.0, CONTINUE)

    def max_prompt_tokens(self) -> int:
        """The longest prompt this environment can pose, in tokens."""
        width = len(str(self.max_operand))
        return 1 + len("Q: ") + (self.num_ops[1] + 1) * width + self.num_ops[1] + 1

    def max_episode_tokens(self, max_tokens_per_turn: int) -> int:
        """An upper bound on a trajectory's length (size a model's context with it)."""
        body = max(len(ERR_EXPRESSION), len(ERR_COMMAND), len(ERR_TOO_LARGE), 13)
        obs = len(OBS_PREFIX) + body + len(OBS_SUFFIX)
        return (
            self.max_prompt_tokens()
            + self.max_turns * max_tokens_per_turn
            + (self.max_turns - 1) * obs
        )


def tool_output(line: str) -> str:
    """The observation body for a non-answer action line — a pure function of the line.

    Args:
      line: the action text without its final newline.

    Returns:
      the result of ``calc <expr>`` as a decimal integer, or an error body (`ERR_EXPRESSION`,
      `ERR_TOO_LARGE`, `ERR_COMMAND` for anything that is not a ``calc`` call).
    """
    if line.startswith("calc "):
        try:
            return str(evaluate(line[len("calc ") :]))
        except CalcError as exc:
            return exc.body
    if line == "calc":
        return ERR_EXPRESSION
    return ERR_COMMAND


# -- trajectories ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Segment:
    """A contiguous span of a trajectory.

    Attributes:
      kind: ``"prompt"``, ``"action"`` or ``"observation"``.
      tokens: int64[n].
      logprobs: float64[n] sampler logprobs (actions; zeros for other kinds).
      body_mask: float64[n], 1.0 on observation-body tokens (zeros for other kinds).
    """

    kind: str
    tokens: np.ndarray
    logprobs: np.ndarray
    body_mask: np.ndarray


class Trajectory:
    """One episode: the prompt, then alternating action turns and observations.

    Build it with `CalcEnv` and `Trajectory.add_action` (which appends the environment's
    observation), or let `rollout` / `expert_trajectory` do it.

    Attributes:
      env, problem: the environment and the problem.
      segments: list of `Segment`, starting with the prompt.
      done, reward, outcome: the episode's state (``outcome`` is the last `StepResult` outcome,
        ``"continue"`` while running).
    """

    def __init__(self, env: CalcEnv, problem: Problem):
        self.env = env
        self.problem = problem
        prompt = env.prompt_tokens(problem)
        zeros = np.zeros(len(prompt))
        self.segments: list[Segment] = [Segment("prompt", prompt, zeros, zeros)]
        self.done = False
        self.reward = 0.0
        self.outcome = CONTINUE

    @property
    def num_turns(self) -> int:
        return sum(s.kind == "action" for s in self.segments)

    @property
    def prompt_length(self) -> int:
        return len(self.segments[0].tokens)

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([s.tokens for s in self.segments])

    @property
    def text(self) -> str:
        return tok.decode(self.tokens)

    @property
    def actions(self) -> list[str]:
        return [tok.decode(s.tokens) for s in self.segments if s.kind == "action"]

    @property
    def observations(self) -> list[str]:
        """The observation bodies, in order."""
        return [
            tok.decode(s.tokens[s.body_mask > 0]) for s in self.segments if s.kind == "observation"
        ]

    def add_action(self, tokens: Any, logprobs: Any = None) -> StepResult:
        """Appends one policy turn and, unless the episode ends, the environment's observation.

        Args:
          tokens: int[n] the turn's tokens, ending with its stop token when it has one. A stop
            token (`STOP_TOKEN_IDS`) anywhere but last is an error: cut the sample first.
          logprobs: float[n] the sampler's logprobs of ``tokens`` (default zeros).

        Returns:
          The environment's `StepResult`.
        """
        if self.done:
            raise ValueError(f"episode is over ({self.outcome}); cannot add another action")
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        lps = np.zeros(len(toks)) if logprobs is None else np.asarray(logprobs, np.float64)
        if lps.shape != toks.shape:
            raise ValueError(
                f"action logprobs have shape {lps.shape}, expected {toks.shape} (one per token)"
            )
        stops = np.isin(toks[:-1], STOP_TOKEN_IDS)
        if stops.any():
            raise ValueError(
                f"action has a stop token at position {int(np.argmax(stops))} before its end; "
                "cut the sample at its first stop token"
            )
        result = self.env.respond(self.problem, tok.decode(toks), self.num_turns)
        zeros = np.zeros(len(toks))
        self.segments.append(Segment("action", toks, lps, zeros))
        if result.observation is not None:
            obs = result.observation
            self.segments.append(
                Segment("observation", obs.tokens, np.zeros(len(obs.tokens)), obs.body_mask)
            )
        self.done, self.reward, self.outcome = result.done, result.reward, result.outcome
        return result

    def terminate(self, outcome: str) -> None:
        """Ends the episode from outside the environment (reward 0.0), e.g. at a context limit.

        A trailing observation is dropped: no policy turn will condition on it, and without it
        the trajectory is no longer than its last policy context plus that turn.
        """
        if self.done:
            raise ValueError(f"episode is over ({self.outcome}); cannot terminate it again")
        if self.segments[-1].kind == "observation":
            self.segments.pop()
        self.done, self.reward, self.outcome = True, 0.0, outcome

    def __repr__(self) -> str:
        return f"Trajectory({self.text!r}, reward={self.reward}, outcome={self.outcome!r})"


def trajectory_to_seq(trajectory: Trajectory) -> Seq:
    """A trajectory as a `runner.Seq`, with target-aligned masks (docs/conventions.md#data-conventions).

    ``tokens`` = [prompt][action][observation][action]...; per-target inputs (entry ``j - 1``
    describes token ``j``):

    * ``action_mask``: 1.0 on every token the policy generated (stop tokens included);
    * ``obs_mask``: 1.0 only on observation *body* tokens (never the ``"= "`` / newline wrappers,
      never the prompt);
    * ``sampling_logprobs``: the sampler's logprobs on action tokens, 0.0 elsewhere.

    The masks are disjoint and the prompt is in neither.

    Args:
      trajectory: a `Trajectory` (finished or not).

    Returns:
      `runner.Seq`.
    """
    cat = np.concatenate
    segs = trajectory.segments
    action = cat([np.full(len(s.tokens), float(s.kind == "action")) for s in segs])
    return make_seq(
        trajectory.tokens,
        action_mask=action[1:],
        obs_mask=cat([s.body_mask for s in segs])[1:],
        sampling_logprobs=(cat([s.logprobs for s in segs]) * action)[1:],
    )


# -- the scripted expert --------------------------------------------------------------------------


def expert_actions(problem: Problem, max_turns: int | None = None) -> list[str]:
    """A correct action script: one ``calc`` per operation (products first), then ``ans``.

    With fewer than ``len(ops) + 1`` turns it uses one ``calc`` of the whole expression, and with
    one turn it answers directly, so the script always fits and always earns reward 1.

    Args:
      problem: the problem.
      max_turns: the environment's turn limit (None = unlimited).

    Returns:
      list of action lines, each ending in a newline.
    """
    answer = f"ans {problem.answer}\n"
    if max_turns is not None and max_turns < len(problem.ops) + 1:
        return [answer] if max_turns < 2 else [f"calc {problem.expression}\n", answer]
    vals, ops, lines = list(problem.operands), list(problem.ops), []
    while ops:
        k = ops.index("*") if "*" in ops else 0
        expr = f"{vals[k]}{ops[k]}{vals[k + 1]}"
        lines.append(f"calc {expr}\n")
        vals[k : k + 2] = [evaluate(expr)]
        del ops[k]
    return lines + [answer]


def expert_trajectory(env: CalcEnv, problem: Problem) -> Trajectory:
    """The expert's finished trajectory (`expert_actions` played through the environment).

    Args:
      env: the environment (its ``max_turns`` shapes the script).
      problem: the problem.

    Returns:
      a finished `Trajectory` with reward 1.0 and zero logprobs.
    """
    traj = Trajectory(env, problem)
    for line in expert_actions(problem, env.max_turns):
        traj.add_action(tok.encode(line))
    return traj


def expert_sft_example(
    env: CalcEnv, problem: Problem, *, supervise: str = "actions"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An SFT demonstration for `runner.sft.collate_sft`: ``(prompt, completion, mask)``.

    Args:
      env: the environment.
      problem: the problem.
      supervise: which completion tokens get weight: ``"actions"`` (default; the policy's
        tokens), ``"actions+obs"`` (plus observation bodies, an ECHO-style world-model target),
        or ``"all"`` (every completion token, wrappers included).

    Returns:
      ``(prompt int64[P], completion int64[C], mask float64[C])``: the expert's actions and
      observations after the prompt, and 0/1 weights.
    """
    choices = ("actions", "actions+obs", "all")
    if supervise not in choices:
        raise ValueError(f"supervise must be one of {choices}, got {supervise!r}")
    traj = expert_trajectory(env, problem)
    rest = traj.segments[1:]
    completion = np.concatenate([s.tokens for s in rest])
    if supervise == "all":
        mask = np.ones(len(completion))
    else:
        parts = [
            np.ones(len(s.tokens))
            if s.kind == "action"
            else (s.body_mask if supervise == "actions+obs" else np.zeros(len(s.tokens)))
            for s in rest
        ]
        mask = np.concatenate(parts)
    return traj.segments[0].tokens, completion, mask


# -- rollout --------------------------------------------------------------------------------------


def _cut_at_stop(tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keeps a sample up to and including its first stop token."""
    stops = np.flatnonzero(np.isin(tokens, STOP_TOKEN_IDS))
    if stops.size:
        end = int(stops[0]) + 1
        return tokens[:end], logprobs[:end]
    return tokens, logprobs


def _turn_seed(seed: int, turn: int) -> int:
    return call_seed(seed, turn)


def rollout(
    trainer: Any,
    env: CalcEnv,
    problems: Sequence[Problem],
    *,
    group_size: int,
    max_tokens_per_turn: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_seq_len: int | None = None,
) -> list[list[Trajectory]]:
    """Runs ``group_size`` multi-turn episodes per problem against a sampler.

    Turn 0 samples ``group_size`` completions of each prompt in one ``sample`` call; each later
    turn samples one continuation of every unfinished trajectory (its full token sequence so far)
    in one call. Each turn stops at a newline or EOS (``stop_token_ids=STOP_TOKEN_IDS``) or after
    ``max_tokens_per_turn`` tokens; a sample that runs past its first stop token is cut there.
    Turn ``t`` samples with a seed derived from ``(seed, t)``. With ``max_seq_len``, an episode
    whose next turn might not fit (``len(tokens) + max_tokens_per_turn - 1 > max_seq_len``, the
    trainer's model-input limit) ends with outcome ``"context_limit"`` and reward 0, without its
    trailing observation, so every returned trajectory fits ``max_seq_len``.

    Args:
      trainer: any object with the `runner.Trainer` ``sample`` method.
      env: the environment.
      problems: the problems (G groups).
      group_size: episodes per problem (≥ 1).
      max_tokens_per_turn: token limit of one policy turn (≥ 1).
      temperature: sampling temperature.
      seed: base sampling seed.
      max_seq_len: optional model-input length limit (see above).

    Returns:
      ``groups[i][k]``: finished `Trajectory` k of problem i (``.reward``, ``.outcome``).
    """
    if not (isinstance(group_size, int) and group_size >= 1):
        raise ValueError(f"rollout: group_size must be an int ≥ 1, got {group_size!r}")
    if not (isinstance(max_tokens_per_turn, int) and max_tokens_per_turn >= 1):
        raise ValueError(
            f"rollout: max_tokens_per_turn must be an int ≥ 1, got {max_tokens_per_turn!r}"
        )
    if max_seq_len is not None and not (isinstance(max_seq_len, int) and max_seq_len >= 1):
        raise ValueError(f"rollout: max_seq_len must be None or an int ≥ 1, got {max_seq_len!r}")
    groups = [[Trajectory(env, p) for _ in range(group_size)] for p in problems]
    turn = 0
    active = [t for g in groups for t in g]
    while True:
        if max_seq_len is not None:
            for t in active:
                if len(t.tokens) + max_tokens_per_turn - 1 > max_seq_len:
                    t.terminate(CONTEXT_LIMIT)
            active = [t for t in active if not t.done]
        if not active:
            break
        if turn == 0:  # one call with group_size samples per prompt (groups share the prompt)
            prompts = [g[0].tokens.tolist() for g in groups if not g[0].done]
            n = group_size
        else:
            prompts = [t.tokens.tolist() for t in active]
            n = 1
        samples = trainer.sample(
            prompts,
            num_samples=n,
            max_tokens=max_tokens_per_turn,
            temperature=temperature,
            seed=_turn_seed(seed, turn),
            stop_token_ids=STOP_TOKEN_IDS,
        )
        if len(samples) != len(prompts) or any(len(s) != n for s in samples):
            raise ValueError(
                f"rollout: sample() returned {[len(s) for s in samples]} samples for "
                f"{len(prompts)} prompts, expected {n} each"
            )
        flat = [s for per_prompt in samples for s in per_prompt]
        for traj, sample in zip(active, flat, strict=True):
            toks = np.asarray(sample.tokens, dtype=np.int64).reshape(-1)[:max_tokens_per_turn]
            lps = np.asarray(sample.logprobs, dtype=np.float64).reshape(-1)[: len(toks)]
            traj.add_action(*_cut_at_stop(toks, lps))
        active = [t for t in active if not t.done]
        turn += 1
    return groups
