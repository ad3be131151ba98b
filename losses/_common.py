"""Small shared helpers: NaN-safe masking, clamped ratios, KL estimators, masked means."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from losses._batch import Batch, count

KL_ESTIMATORS = ("k1", "k2", "k3")


def safe(x_BT: jax.Array, valid_BT: jax.Array) -> jax.Array:
    """``where(valid, x, 0)``: masked entries may hold inf/nan; value and gradient stay finite.

    This is the first half of the double-``where`` pattern: the masked values never reach an
    ``exp``/``log``, so their cotangent is exactly 0 instead of ``0·inf = nan``.
    """
    return jnp.where(valid_BT, x_BT, jnp.zeros((), x_BT.dtype))


def per_token_advantages(batch: Batch, valid_BT: jax.Array, term: str) -> jax.Array:
    """Advantages broadcast to ``[B, T]``, stop-gradiented, 0 (not nan) on masked tokens."""
    adv = batch.advantages
    if adv is None:
        raise ValueError(f"{term} needs batch field 'advantages', which is None")
    adv = jax.lax.stop_gradient(jnp.asarray(adv))
    if adv.ndim == 1:
        adv = jnp.broadcast_to(adv[:, None], valid_BT.shape)
    return safe(adv, valid_BT)


def clamped_log_ratio(
    logprobs_BT: jax.Array, anchor_BT: jax.Array, valid_BT: jax.Array, max_log_ratio: float
) -> jax.Array:
    """``clip(p - anchor, ±max_log_ratio)`` on valid tokens, 0 elsewhere (anchor stop-gradiented)."""
    anchor = jax.lax.stop_gradient(anchor_BT)
    diff = safe(logprobs_BT, valid_BT) - safe(anchor, valid_BT)
    return jnp.clip(diff, -max_log_ratio, max_log_ratio)


def kl_penalty(
    logprobs_BT: jax.Array,
    ref_BT: jax.Array,
    valid_BT: jax.Array,
    *,
    estimator: str,
    max_log_ratio: float,
) -> jax.Array:
    """Per-token KL estimate ``k(p, ref)`` with its true gradient in ``p``; 0 on masked tokens.

    With ``δ = clip(p - ref, ±max_log_ratio)`` (Schulman, "Approximating KL divergence", 2020):
    ``k1 = δ`` (gradient 1), ``k2 = δ²/2`` (gradient δ), ``k3 = exp(-δ) + δ - 1`` (gradient
    ``1 - exp(-δ)``), computed as ``expm1(-δ) + δ`` for precision at small δ.
    """
    delta = clamped_log_ratio(logprobs_BT, ref_BT, valid_BT, max_log_ratio)
    if estimator == "k1":
        k = delta
    elif estimator == "k2":
        k = 0.5 * jnp.square(delta)
    elif estimator == "k3":
        k = jnp.expm1(-delta) + delta
    else:  # pragma: no cover - validated by constructors
        raise ValueError(f"unknown kl_estimator {estimator!r}")
    return safe(k, valid_BT)


def masked_mean(x_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    """``Σ x·m / max(Σ m, 1)``, stop-gradiented (a metric)."""
    x = jax.lax.stop_gradient(x_BT)
    m = mask_BT.astype(x.dtype)
    return jnp.sum(jnp.where(mask_BT > 0, x * m, 0.0)) / jnp.maximum(count(m), 1.0)


def check_number(where: str, name: str, value, *, low=None, high=None, low_open=False) -> float:
    """Validates a scalar hyperparameter eagerly; returns it as float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: {name} must be finite, got {value!r}")
    if low is not None and (v <= low if low_open else v < low):
        op = ">" if low_open else ">="
        raise ValueError(f"{where}: {name} must be {op} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{where}: {name} must be <= {high}, got {value!r}")
    return v


def check_choice(where: str, name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{where}: unknown {name} {value!r}; expected one of {tuple(choices)}")
    return value


def ppo_clip_terms(
    log_ratio_BT: jax.Array,
    adv_BT: jax.Array,
    *,
    ratio_low: float,
    ratio_high: float,
    dual_clip: float | None = None,
) -> jax.Array:
    """Per-token clipped surrogate ``-min(r·A, clip(r, ratio_low, ratio_high)·A)``; float[B, T].

    ``ratio_low``/``ratio_high`` are absolute ratio bounds (``1 - ε_lo``, ``1 + ε_hi``). With
    ``dual_clip = c`` and ``A < 0`` the loss is capped at ``-c·A`` (Ye et al. 2020, verl
    ``clip_ratio_c``). No reduction.

    Args:
      log_ratio_BT: ``log r`` (already clamped and 0 on masked tokens); float[B, T].
      adv_BT: advantages, stop-gradiented, 0 on masked tokens; float[B, T].
      ratio_low: lower absolute ratio bound.
      ratio_high: upper absolute ratio bound.
      dual_clip: optional ``c > 1``.

    Returns:
      float[B, T] per-token losses.
    """
    ratio = jnp.exp(log_ratio_BT)
    unclipped = -adv_BT * ratio
    clipped = -adv_BT * jnp.clip(ratio, ratio_low, ratio_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(adv_BT < 0, jnp.minimum(loss, -dual_clip * adv_BT), loss)
    return loss
