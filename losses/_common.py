"""Small shared helpers: NaN-safe masking, clamped ratios, KL estimators, masked means."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from losses._batch import Batch, count

KL_ESTIMATORS = ("k1", "k2", "k3")
#: Per-token KL forms toward the **sampler** (``sampling_logprobs``; `losses.sampler_kl`,
#: `losses.dppo_tv_kl`), estimated on the tokens the sampler drew (see `kl_penalty`).
SAMPLER_KL_FORMS = ("sq_log_ratio", "rllm_bwd", "rllm_bwd_sf", "rllm_fwd")
#: Every form `kl_penalty` computes.
KL_FORMS = KL_ESTIMATORS + SAMPLER_KL_FORMS


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


def _with_gradient(value_BT: jax.Array, coef_BT: jax.Array, delta_BT: jax.Array) -> jax.Array:
    """Value ``value``, gradient ``sg(coef)·∂δ`` (straight-through; ``δ - sg(δ)`` is 0 forward)."""
    sg = jax.lax.stop_gradient
    return sg(value_BT) + sg(coef_BT) * (delta_BT - sg(delta_BT))


def kl_penalty(
    logprobs_BT: jax.Array,
    ref_BT: jax.Array,
    valid_BT: jax.Array,
    *,
    estimator: str,
    max_log_ratio: float,
    score_function: bool = False,
    importance_log_ratio: jax.Array | None = None,
) -> jax.Array:
    """Per-token KL estimate ``k(p, target)`` with its stated gradient in ``p``; 0 on masked tokens.

    With ``δ = clip(p - target, ±max_log_ratio)`` (the gradient is 0 where the clamp binds) and
    ``ρ = e^δ`` (docs/sources.md#kl-variants):

    ================  ===========================  ====================  =========================
    ``estimator``     value                        ``∂/∂p``              source
    ================  ===========================  ====================  =========================
    ``k1``            ``δ``                        ``1``                 Schulman 2020
    ``k2``            ``δ²/2``                     ``δ``                 Schulman 2020
    ``k3``            ``e^{-δ} + δ - 1``           ``1 - e^{-δ}``        Schulman 2020 (``expm1``)
    ``sq_log_ratio``  ``δ²``                       ``2δ``                prime-rl ``(log r)²``
    ``rllm_bwd``      ``ρ - 1 - δ``                ``ρ - 1``             rllm ``kl_approx=True``
    ``rllm_bwd_sf``   ``ρ - 1 - δ``                ``-1``                rllm ``kl_approx=False``
    ``rllm_fwd``      ``ρ·δ - ρ + 1``              ``ρ·δ``               rllm (both forms)
    ================  ===========================  ====================  =========================

    ``k1``-``k3`` estimate ``KL(p‖target)`` on tokens drawn from ``p``; the rllm forms estimate
    ``KL(target‖p)`` (``bwd``) and ``KL(p‖target)`` (``fwd``) on tokens drawn from the target
    (the sampler). ``score_function=True`` (``k1``-``k3`` only) keeps the value and replaces the
    gradient by the score-function coefficient ``δ`` (verl ``k1+``/``k3+``; ``k1`` with it is
    the unbiased score-function k1 form, i.e. k1 in the reward). ``rllm_bwd_sf`` is always a
    score-function form.

    ``importance_log_ratio`` (``clip(p - old, ±max)``, when given) multiplies the estimate by
    ``r = e^{importance_log_ratio}``: **differentiable** for the pathwise forms (DeepSeek-V3.2 /
    TRL ``use_bias_correction_kl``: ``∂(r·k3)/∂p = r·δ``; ``∂(r·k1)/∂p = r·(δ + 1)``), detached for
    the score-function forms (gradient ``r·δ``, OpenRLHF PR #1309), whose gradient already is
    the per-sample gradient.

    Args:
      logprobs_BT: current logprobs ``p``; float[B, T].
      ref_BT: the target's logprobs (stop-gradiented); float[B, T].
      valid_BT: bool[B, T], the tokens that count.
      estimator: one of `KL_FORMS`.
      max_log_ratio: the clamp of ``p - target``.
      score_function: score-function gradient (``k1``-``k3`` only).
      importance_log_ratio: optional float[B, T] log importance weight.

    Returns:
      float[B, T] per-token values (0 off ``valid_BT``).
    """
    delta = clamped_log_ratio(logprobs_BT, ref_BT, valid_BT, max_log_ratio)
    score = score_function or estimator == "rllm_bwd_sf"
    if estimator == "k1":
        k = delta
    elif estimator == "k2":
        k = 0.5 * jnp.square(delta)
    elif estimator == "k3":
        k = jnp.expm1(-delta) + delta
    elif estimator == "sq_log_ratio":
        k = jnp.square(delta)
    elif estimator in ("rllm_bwd", "rllm_bwd_sf"):
        k = jnp.expm1(delta) - delta
    elif estimator == "rllm_fwd":
        k = delta * jnp.exp(delta) - jnp.expm1(delta)
    else:  # pragma: no cover - validated by constructors
        raise ValueError(f"unknown kl_estimator {estimator!r}")
    if score:
        coef = -jnp.ones_like(delta) if estimator == "rllm_bwd_sf" else delta
        k = _with_gradient(k, coef, delta)
    if importance_log_ratio is not None:
        ratio = jnp.exp(importance_log_ratio)
        k = (jax.lax.stop_gradient(ratio) if score else ratio) * k
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
    delta: float | None = None,
) -> jax.Array:
    """Per-token clipped surrogate ``-min(r·A, clip(r, ratio_low, ratio_high)·A)``; float[B, T].

    ``ratio_low``/``ratio_high`` are absolute ratio bounds (``1 - ε_lo``, ``1 + ε_hi``). With
    ``dual_clip = c`` and ``A < 0`` the loss is capped at ``-c·A`` (Ye et al. 2020, verl
    ``clip_ratio_c``). With ``delta = δ`` the unclipped branch uses ``min(r, δ)`` (TRL
    ``delta``, INTELLECT-2): ``-min(min(r, δ)·A, clip(r)·A)``. No reduction.

    Args:
      log_ratio_BT: ``log r`` (already clamped and 0 on masked tokens); float[B, T].
      adv_BT: advantages, stop-gradiented, 0 on masked tokens; float[B, T].
      ratio_low: lower absolute ratio bound.
      ratio_high: upper absolute ratio bound.
      dual_clip: optional ``c > 1``.
      delta: optional ``δ > 1``, the cap of the unclipped ratio.

    Returns:
      float[B, T] per-token losses.
    """
    ratio = jnp.exp(log_ratio_BT)
    unclipped = -adv_BT * (ratio if delta is None else jnp.minimum(ratio, delta))
    clipped = -adv_BT * jnp.clip(ratio, ratio_low, ratio_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(adv_BT < 0, jnp.minimum(loss, -dual_clip * adv_BT), loss)
    return loss
