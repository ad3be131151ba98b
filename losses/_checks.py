"""Host-side value validation of a `Batch` (never inside jitted code)."""

from __future__ import annotations

from typing import Any

import numpy as np

from losses._batch import Batch

_MASKS = ("action_mask", "obs_mask")
_LOGPROB_FIELDS = ("sampling_logprobs", "old_logprobs", "ref_logprobs")


def _first(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _at(idx: tuple[int, ...]) -> str:
    if len(idx) == 2:
        return f"row {idx[0]}, column {idx[1]}"
    return f"row {idx[0]}"


def check_batch(batch: Batch, logprobs: Any = None) -> None:
    """Validates a batch's values on the host; raises ``ValueError`` naming field, row and column.

    Rules (DESIGN.md §6):

    * ``action_mask`` and ``obs_mask`` hold only 0 and 1, and never overlap;
    * ``logprobs`` (if given) and ``sampling/old/ref_logprobs`` are finite and ≤ 0 on the tokens
      their terms read (action or observation tokens for ``logprobs``; action tokens for the
      anchors);
    * ``advantages`` are finite on action tokens;
    * ``weights`` are finite everywhere;
    * the carried normalizers are finite and ≥ 0;
    * ``logprobs`` has the batch's ``[B, T]`` shape.

    Args:
      batch: the `Batch` (shapes were checked at construction).
      logprobs: optional float[B, T] current-policy logprobs.

    Returns:
      None; the batch is valid when no error is raised.

    Raises:
      ValueError: on the first violated rule, with the field, the row and column, and the rule.
    """
    am = np.asarray(batch.action_mask)
    bt = am.shape
    masks = {}
    for name in _MASKS:
        value = batch.get(name)
        if value is None:
            continue
        m = np.asarray(value)
        bad = ~((m == 0) | (m == 1))
        if bad.any():
            idx = _first(bad)
            raise ValueError(f"{name}[{_at(idx)}] = {float(m[idx]):g}: masks must hold only 0 or 1")
        masks[name] = m > 0
    action = masks["action_mask"]
    obs = masks.get("obs_mask", np.zeros(bt, bool))
    overlap = action & obs
    if overlap.any():
        idx = _first(overlap)
        raise ValueError(
            f"action_mask and obs_mask overlap at {_at(idx)}: a token is either an action or an "
            "observation"
        )
    if logprobs is not None:
        lp = np.asarray(logprobs)
        if lp.shape != bt:
            raise ValueError(f"logprobs has shape {lp.shape}, expected {bt} like action_mask")
        _check_logprob_values("logprobs", lp, action | obs)
    for name in _LOGPROB_FIELDS:
        value = batch.get(name)
        if value is not None:
            _check_logprob_values(name, np.asarray(value), action)
    adv = batch.get("advantages")
    if adv is not None:
        a = np.asarray(adv)
        where = action if a.ndim == 2 else action.any(axis=1)
        bad = where & ~np.isfinite(a)
        if bad.any():
            idx = _first(bad)
            raise ValueError(
                f"advantages[{_at(idx)}] = {float(a[idx]):g}: advantages must be finite"
            )
    weights = batch.get("weights")
    if weights is not None:
        w = np.asarray(weights)
        bad = ~np.isfinite(w)
        if bad.any():
            idx = _first(bad)
            raise ValueError(f"weights[{_at(idx)}] = {float(w[idx]):g}: weights must be finite")
    for name in ("num_rows", "num_action_tokens", "num_obs_tokens"):
        value = batch.get(name)
        if value is not None:
            v = float(np.asarray(value))
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"{name} = {v!r}: normalizers must be finite and >= 0")


def _check_logprob_values(name: str, values: np.ndarray, where: np.ndarray) -> None:
    bad = where & ~np.isfinite(values)
    if bad.any():
        idx = _first(bad)
        raise ValueError(
            f"{name}[{_at(idx)}] = {float(values[idx]):g} on an unmasked token: logprobs must be finite"
        )
    bad = where & (values > 0)
    if bad.any():
        idx = _first(bad)
        raise ValueError(
            f"{name}[{_at(idx)}] = {float(values[idx]):g} > 0 on an unmasked token: log-probabilities "
            "must be <= 0"
        )
