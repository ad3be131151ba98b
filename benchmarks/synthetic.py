"""Synthetic multi-turn runner sequences: the one factory of the benchmarks and the tests.

Each sequence is ``[prompt][action][obs]([wrapper])[action][obs]...``: per-target kinds 0 (prompt,
wrapper or padding-like: in neither mask), 1 (action) and 2 (observation), with GRPO inputs on the
action tokens. Benchmark scripts import it as ``synthetic`` (after ``_common.setup()``), the tests
as ``benchmarks.synthetic``; it imports neither pytest nor the benchmark helpers.

Every random draw comes from the ``rng`` given, in a fixed order (so a seed gives the same
sequences whatever else the caller does with its own generator), per sequence:

  layout   ``lengths`` (unless the first sequence's ``first_length``), ``start``, the turn lengths
           of `turn_kinds`, then the token ids (``vocab``)
  logprobs ``-Exp(1)`` (``logprobs="exponential"``)
  inputs   the advantage, then ``sampling_logprobs`` noise (or ``-U(anchors)``), then
           ``ref_logprobs`` (``-U(anchors)``, only without logprobs)

except with a ``trainer``: then every sequence's layout comes first, then one forward over all of
them, then every sequence's inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def turn_kinds(
    rng: np.random.Generator,
    n: int,
    start: int,
    action_turn: tuple[int, int],
    obs_turn: tuple[int, int],
    gap: int = 0,
) -> np.ndarray:
    """int8[n] token kinds of a multi-turn sequence: 0 before ``start`` (prompt), then
    alternating action (1) and observation (2) turns with lengths drawn from
    ``rng.integers(*action_turn)`` and ``rng.integers(*obs_turn)``, each observation turn followed
    by ``gap`` wrapper targets of kind 0."""
    kind = np.zeros(n, np.int8)
    t = start
    while t < n:
        a = int(rng.integers(*action_turn))
        kind[t : t + a] = 1
        t += a
        o = int(rng.integers(*obs_turn))
        kind[t : t + o] = 2
        t += o + gap
    return kind


def multi_turn_seqs(
    rng: np.random.Generator,
    n: int | None = None,
    *,
    lengths: tuple[int, int] = (12, 30),
    first_length: int | None = None,
    start: int | tuple[int, int] = (3, 6),
    action_turn: tuple[int, int] = (2, 6),
    obs_turn: tuple[int, int] = (1, 4),
    gap: int = 0,
    ensure_action: bool = False,
    vocab: int | None = None,
    layouts: Sequence[Any] | None = None,
    trainer: Any = None,
    logprobs: str | None = None,
    sampling_noise: float = 0.3,
    with_ref: bool = False,
    ref_offset: float = 0.1,
    anchors: tuple[float, float] = (1.0, 5.0),
) -> tuple[list[Any], list[np.ndarray] | None]:
    """``n`` synthetic `runner.Seq` with multi-turn masks and GRPO inputs, and their logprobs.

    Args:
      rng: the generator every draw comes from (order: see the module docstring).
      n: number of sequences (not with ``layouts``).
      lengths: tokens per sequence, ``rng.integers(*lengths)`` (targets = tokens - 1).
      first_length: the first sequence's token count, not drawn (the others use ``lengths``).
      start: the first action target, an int or drawn as ``rng.integers(*start)``; at most the
        number of targets.
      action_turn, obs_turn, gap: turn lengths and wrapper targets of `turn_kinds`.
      ensure_action: a sequence without an action target gets its last target as one.
      vocab: token ids drawn as ``rng.integers(0, vocab)`` after the layout; None: all zeros.
      layouts: `runner.Seq` whose tokens, ``action_mask`` and ``obs_mask`` are used instead of
        drawing layouts (then only the inputs are drawn).
      trainer: logprobs from ``trainer.forward`` of the tokens (float64, at the current weights;
        the forward is not counted in ``trainer.counters``).
      logprobs: without a trainer, ``"exponential"``: float32 logprobs ``-Exp(1)`` per sequence;
        None: no logprobs.
      sampling_noise: with logprobs, ``sampling_logprobs = min(lp + N(0, sampling_noise), 0)``
        on action targets (ratios near 1, some clipped); without, ``-U(anchors)``.
      with_ref: also ``ref_logprobs``: ``min(lp - ref_offset, 0)`` with logprobs (no draw),
        ``-U(anchors)`` without.
      ref_offset: see ``with_ref``.
      anchors: the uniform range of the anchors without logprobs.

    Returns:
      ``(seqs, lps)``: the sequences and the per-sequence logprobs their inputs were drawn
      around (None without logprobs).
    """
    from runner import Seq

    if logprobs not in (None, "exponential"):
        raise ValueError(f"logprobs must be None or 'exponential', got {logprobs!r}")
    if trainer is not None and logprobs is not None:
        raise ValueError("give a trainer or logprobs='exponential', not both")

    def layout(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        length = (
            first_length if i == 0 and first_length is not None else int(rng.integers(*lengths))
        )
        targets = length - 1
        first = start if isinstance(start, int) else int(rng.integers(*start))
        kind = turn_kinds(rng, targets, min(first, targets), action_turn, obs_turn, gap)
        if ensure_action and not (kind == 1).any():
            kind[-1] = 1
        if vocab is None:
            tokens = np.zeros(length, np.int64)
        else:
            tokens = rng.integers(0, vocab, length).astype(np.int64)
        return tokens, (kind == 1).astype(np.float64), (kind == 2).astype(np.float64)

    def inputs(action: np.ndarray, obs: np.ndarray, lp: np.ndarray | None) -> dict:
        out = dict(action_mask=action, obs_mask=obs, advantages=float(rng.normal()) * action)
        if lp is None:
            out["sampling_logprobs"] = -rng.uniform(*anchors, action.shape[0]) * action
            if with_ref:
                out["ref_logprobs"] = -rng.uniform(*anchors, action.shape[0]) * action
        else:
            noise = rng.normal(0.0, sampling_noise, lp.shape)
            out["sampling_logprobs"] = np.minimum(lp + noise, 0.0) * action
            if with_ref:
                out["ref_logprobs"] = np.minimum(lp - ref_offset, 0.0) * action
        return out

    if (n is None) == (layouts is None):
        raise ValueError("give n or layouts (not both)")
    given = None
    if layouts is not None:
        given = [(s.tokens, s.inputs["action_mask"], s.inputs["obs_mask"]) for s in layouts]
        n = len(given)
    if trainer is None:  # one sequence after another: layout, logprobs, inputs
        seqs, lps = [], []
        for i in range(n):
            tokens, action, obs = layout(i) if given is None else given[i]
            lp = None
            if logprobs == "exponential":
                lp = -rng.exponential(1.0, tokens.shape[0] - 1).astype(np.float32)
                lps.append(lp)
            seqs.append(Seq(tokens, inputs(action, obs, lp)))
        return seqs, (lps if logprobs else None)
    raw = [layout(i) for i in range(n)] if given is None else given
    counters = dict(getattr(trainer, "counters", {}))
    fwd = trainer.forward([Seq(tokens) for tokens, _, _ in raw])
    if counters:
        trainer.counters.update(counters)
    lps = [np.asarray(lp, np.float64) for lp in fwd]
    seqs = [
        Seq(tokens, inputs(action, obs, lp))
        for (tokens, action, obs), lp in zip(raw, lps, strict=True)
    ]
    return seqs, lps
