"""Value validation of a `Batch`: the host check that names the entry, and its in-graph count.

One set of rules (docs/conventions.md#bad-input), in two forms that must agree:

* `check_batch` — on the host (numpy), raises ``ValueError`` naming field, row, column and rule;
* `any_violation` — jittable: whether any entry breaks a rule, computed from the same arrays
  inside the caller's jitted function (one fused reduction, no pass over host memory). A runner
  calls it in its jitted step and, only when it is true, runs `check_batch` on the host to say
  where.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from losses._batch import (
    ARGUMENTS,
    GLOBAL_FIELDS,
    LOGPROB_FIELDS,
    MASK_FIELDS,
    NORMALIZER_FIELDS,
    ROW_FIELDS,
    TOPK_FIELDS,
    VALUE_FIELDS,
    Batch,
)

#: Largest log-probability accepted (float32 log-softmax may round a hair above 0).
MAX_LOGPROB = 1e-4


def _first(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _at(idx: tuple[int, ...], names: tuple[str, str] = ("row", "column")) -> str:
    if len(idx) == 2:
        return f"{names[0]} {idx[0]}, {names[1]} {idx[1]}"
    return f"{names[0]} {idx[0]}"


def _finite_in(values: np.ndarray, dtype: Any) -> np.ndarray:
    """Finite, and representable (not overflowing) in ``dtype`` (None = the array's own)."""
    ok = np.isfinite(values)
    if dtype is not None and np.dtype(dtype).kind == "f":
        big = float(np.finfo(dtype).max)
        if np.finfo(values.dtype).max > big:
            with np.errstate(invalid="ignore"):
                ok &= np.abs(values) <= big
    return ok


def _what(name: str, value: float, dtype: Any) -> str:
    if np.isfinite(value) and dtype is not None:
        return f"overflows {np.dtype(dtype).name} (its largest value is {float(np.finfo(dtype).max):g})"
    return "must be finite"


def check_batch(
    batch: Batch,
    logprobs: Any = None,
    *,
    dtype: Any = None,
    index_names: tuple[str, str] = ("row", "column"),
    term: Any = None,
) -> None:
    """Validates a batch's values on the host; raises ``ValueError`` naming field, row and column.

    Rules (docs/conventions.md#bad-input), the same as `any_violation`:

    * ``action_mask`` and ``obs_mask`` hold only 0 and 1, and never overlap;
    * ``logprobs`` (if given) and ``sampling/old/ref_logprobs`` are finite and ``≤ 0`` (up to
      `MAX_LOGPROB`) on the tokens their terms read (action or observation tokens for
      ``logprobs``; action tokens for the anchors);
    * ``advantages`` are finite on action tokens;
    * ``weights`` are finite everywhere;
    * ``teacher_logprobs`` like the anchors; ``teacher_topk_logprobs`` finite and ``≤ 0`` at
      every K on action tokens; ``old_values`` and ``returns`` finite on action tokens;
      ``labels`` 0 or 1;
    * the carried normalizers are finite and ≥ 0; ``kl_baseline`` finite, ``is_weight_mean``
      finite and > 0;
    * with ``term``, the term's own rules (``term.validate``, e.g. preference pairs);
    * with ``dtype`` (e.g. float32, the dtype a runner computes in), every checked value must
      also be representable in it: a float64 ``1e39`` would become ``inf``;
    * ``logprobs`` has the batch's ``[B, T]`` shape (or ``[B, T, K]``: the student logprobs of the
      top-K distillation terms, each K checked); with ``term``, the first argument follows
      ``term.argument`` (`losses.ARGUMENTS`): ``"values"`` (the critic's predictions) are only
      required to be finite on action tokens, ``"topk_logprobs"`` must be ``[B, T, K]``.

    Args:
      batch: the `Batch` (shapes were checked at construction).
      logprobs: optional float[B, T] current-policy logprobs (the term's first argument).
      dtype: the float dtype the values will be computed in; ``None`` = their own.
      index_names: what the two axes are called in messages (a runner says
        ``("sequence", "target")``).
      term: optional `Term` whose ``validate`` rules are checked too.

    Returns:
      None; the batch is valid when no error is raised.

    Raises:
      ValueError: on the first violated rule, with the field, the row and column, and the rule.
    """
    am = np.asarray(batch.action_mask)
    bt = am.shape
    masks = {}
    for name in MASK_FIELDS:
        value = batch.get(name)
        if value is None:
            continue
        m = np.asarray(value)
        bad = ~((m == 0) | (m == 1))
        if bad.any():
            idx = _first(bad)
            raise ValueError(
                f"{name}[{_at(idx, index_names)}] = {float(m[idx]):g}: masks must hold only 0 or 1"
            )
        masks[name] = m > 0
    action = masks["action_mask"]
    obs = masks.get("obs_mask", np.zeros(bt, bool))
    overlap = action & obs
    if overlap.any():
        idx = _first(overlap)
        raise ValueError(
            f"action_mask and obs_mask overlap at {_at(idx, index_names)}: a token is either an action or an "
            "observation"
        )
    if logprobs is not None:
        _check_argument(
            getattr(term, "argument", None), np.asarray(logprobs), action, obs, dtype, index_names
        )
    for name in LOGPROB_FIELDS:
        value = batch.get(name)
        if value is not None:
            _check_logprob_values(name, np.asarray(value), action, dtype, index_names)
    adv = batch.get("advantages")
    if adv is not None:
        a = np.asarray(adv)
        where = action if a.ndim == 2 else action.any(axis=1)
        bad = where & ~_finite_in(a, dtype)
        if bad.any():
            idx = _first(bad)
            v = float(a[idx])
            raise ValueError(
                f"advantages[{_at(idx, index_names)}] = {v:g}: advantages {_what('a', v, dtype)}"
            )
    weights = batch.get("weights")
    if weights is not None:
        w = np.asarray(weights)
        bad = ~_finite_in(w, dtype)
        if bad.any():
            idx = _first(bad)
            v = float(w[idx])
            raise ValueError(
                f"weights[{_at(idx, index_names)}] = {v:g}: weights {_what('w', v, dtype)}"
            )
    for name in TOPK_FIELDS:
        value = batch.get(name)
        if value is not None:
            k = np.asarray(value)
            _check_logprob_values(name, k.max(axis=2), action, dtype, index_names)
            _check_logprob_values(name, k.min(axis=2), action, dtype, index_names)
    for name in VALUE_FIELDS:
        value = batch.get(name)
        if value is not None:
            _check_finite_on(name, np.asarray(value), action, dtype, index_names, "values")
    for name in ROW_FIELDS:
        value = batch.get(name)
        if value is not None:
            x = np.asarray(value)
            bad = ~((x == 0) | (x == 1))
            if bad.any():
                idx = _first(bad)
                raise ValueError(
                    f"{name}[{_at(idx, index_names)}] = {float(x[idx]):g}: labels must be 0 or 1"
                )
    for name in NORMALIZER_FIELDS:
        value = batch.get(name)
        if value is not None:
            v = float(np.asarray(value))
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"{name} = {v!r}: normalizers must be finite and >= 0")
    for name in GLOBAL_FIELDS:
        value = batch.get(name)
        if value is not None:
            v = float(np.asarray(value))
            positive = name == "is_weight_mean"
            if not np.isfinite(v) or (positive and v <= 0):
                rule = "finite and > 0" if positive else "finite"
                raise ValueError(f"{name} = {v!r}: must be {rule}")
    validate = getattr(term, "validate", None)
    if validate is not None:
        validate(batch, logprobs)


def _check_finite_on(
    name: str,
    x: np.ndarray,
    action: np.ndarray,
    dtype: Any,
    index_names: tuple[str, str],
    what: str,
) -> None:
    """``x`` finite (and representable in ``dtype``) on action tokens, else ``ValueError``."""
    bad = action & ~_finite_in(x, dtype)
    if bad.any():
        idx = _first(bad)
        v = float(x[idx])
        raise ValueError(
            f"{name}[{_at(idx, index_names)}] = {v:g} on an action token: {what} "
            f"{_what(name, v, dtype)}"
        )


def _check_argument(
    argument: str | None,
    x: np.ndarray,
    action: np.ndarray,
    obs: np.ndarray,
    dtype: Any,
    index_names: tuple[str, str],
) -> None:
    """The first argument's rules (`losses.ARGUMENTS`; ``None``: logprobs [B, T] or [B, T, K])."""
    bt = action.shape
    if argument == "values":
        if x.shape != bt:
            raise ValueError(f"values have shape {x.shape}, expected {bt} like action_mask")
        _check_finite_on("values", x, action, dtype, index_names, "value predictions")
        return
    topk = x.ndim == 3 and x.shape[:2] == bt and x.shape[2] >= 1
    if argument == "topk_logprobs" and not topk:
        raise ValueError(
            f"logprobs have shape {x.shape}, expected top-K logprobs [B, T, K] with [B, T] = {bt}"
        )
    if topk and argument in (None, "topk_logprobs"):
        # [B, T, K] student logprobs of the top-K distillation terms: every K is checked.
        for k in (x.max(axis=2), x.min(axis=2)):
            _check_logprob_values("logprobs", k, action | obs, dtype, index_names)
        return
    if x.shape != bt:
        expected = f"{bt} like action_mask" + (" (or [B, T, K])" if argument is None else "")
        raise ValueError(f"logprobs has shape {x.shape}, expected {expected}")
    _check_logprob_values("logprobs", x, action | obs, dtype, index_names)


def _check_logprob_values(
    name: str, values: np.ndarray, where: np.ndarray, dtype: Any, index_names: tuple[str, str]
) -> None:
    bad = where & ~_finite_in(values, dtype)
    if bad.any():
        idx = _first(bad)
        v = float(values[idx])
        rule = (
            "logprobs must be finite"
            if not np.isfinite(v) or dtype is None
            else f"logprobs {_what(name, v, dtype)}"
        )
        raise ValueError(f"{name}[{_at(idx, index_names)}] = {v:g} on an unmasked token: {rule}")
    with np.errstate(invalid="ignore"):
        bad = where & (values > MAX_LOGPROB)
    if bad.any():
        idx = _first(bad)
        raise ValueError(
            f"{name}[{_at(idx, index_names)}] = {float(values[idx]):g} > 0 on an unmasked token: log-probabilities "
            "must be <= 0"
        )


def any_violation(batch: Batch, logprobs: Any = None, *, argument: str = "logprobs") -> Any:
    """Whether any entry breaks a `check_batch` rule; jittable, bool scalar.

    The same rules as `check_batch` on the batch's own dtype (a value that overflowed in a cast
    is ``inf`` here, and so counted). Carried normalizers are host floats and are checked by
    `check_batch`, not here. Each rule is one elementwise predicate; they are or-ed and reduced
    with ``any`` (cheaper than a count in XLA:CPU), so inside a jitted loss this is one fused
    pass.

    Args:
      batch: a `Batch` (possibly of tracers).
      logprobs: the term's optional first argument: float[B, T] current-policy logprobs, or
        what ``argument`` says.
      argument: what ``logprobs`` is (`losses.ARGUMENTS`, a term's ``argument``):
        ``"logprobs"`` (finite, ``≤ 0`` where read), ``"topk_logprobs"`` ([B, T, K], each K
        so) or ``"values"`` (finite on action tokens).

    Returns:
      bool[]: True when some entry is invalid.
    """
    am = batch.action_mask
    action = am > 0
    bad = (am != 0) & (am != 1)
    obs = None
    if batch.obs_mask is not None:
        om = batch.obs_mask
        obs = om > 0
        bad = bad | ((om != 0) & (om != 1)) | (action & obs)
    read = action if obs is None else action | obs
    if logprobs is not None:
        lp = jnp.asarray(logprobs)
        if argument == "values":
            bad = bad | (action & ~jnp.isfinite(lp))
        elif argument == "topk_logprobs":
            bad = bad | (read & ~jnp.all(jnp.isfinite(lp) & (lp <= MAX_LOGPROB), axis=2))
        elif argument == "logprobs":
            bad = bad | (read & ~(jnp.isfinite(lp) & (lp <= MAX_LOGPROB)))
        else:
            raise ValueError(
                f"any_violation: argument must be one of {ARGUMENTS}, got {argument!r}"
            )
    for name in LOGPROB_FIELDS:
        value = batch.get(name)
        if value is not None:
            bad = bad | (action & ~(jnp.isfinite(value) & (value <= MAX_LOGPROB)))
    adv = batch.advantages
    if adv is not None:
        if adv.ndim == 2:
            bad = bad | (action & ~jnp.isfinite(adv))
        else:
            bad = bad | (action & ~jnp.isfinite(adv)[:, None])
    if batch.weights is not None:
        bad = bad | ~jnp.isfinite(batch.weights)
    for name in TOPK_FIELDS:
        value = batch.get(name)
        if value is not None:
            ok = jnp.all(jnp.isfinite(value) & (value <= MAX_LOGPROB), axis=2)
            bad = bad | (action & ~ok)
    for name in VALUE_FIELDS:
        value = batch.get(name)
        if value is not None:
            bad = bad | (action & ~jnp.isfinite(value))
    out = jnp.any(bad)
    for name in ROW_FIELDS:
        value = batch.get(name)
        if value is not None:
            out = out | jnp.any((value != 0) & (value != 1))
    return out
