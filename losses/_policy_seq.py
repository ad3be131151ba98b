"""Sequence-level policy terms: GSPO (GSPO-token gradient form), LUSPO and GMPO (a sequence
ratio), and VESPO (a detached sequence weight).

Both compute a per-row ratio from the masked mean of the token log-ratios. Padding and masked
tokens never enter the mean (the denominator is the row's action-token count ``N_i``), and every
per-row quantity is row-local, so micro-batching (`losses.split_batch`), row permutation and
padding leave the value and the gradient unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Term, Twin
from losses._common import (
    check_number,
    ppo_clip_terms,
)
from losses._correction import as_correction
from losses._policy import TWIN_MAX_LOG_RATIO, _common_args, policy_term, ratio_bounds

#: GSPO paper / TRL recipe clip offsets (ε_lo, ε_hi).
GSPO_DEFAULT_OFFSETS = (3e-4, 4e-4)


def _row_mean(x_BT: jax.Array, m_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(Σ_t m·x / max(N_i, 1), N_i)`` per row, both float[B, 1]."""
    n = jnp.sum(m_BT, axis=1, keepdims=True, dtype=jnp.promote_types(m_BT.dtype, jnp.float32))
    return jnp.sum(x_BT * m_BT, axis=1, keepdims=True) / jnp.maximum(n, 1.0), n


def _active_row_mean(x_B1: jax.Array, n_B1: jax.Array) -> jax.Array:
    rows = (n_B1 > 0).astype(x_B1.dtype)
    x = jax.lax.stop_gradient(x_B1)
    return jnp.sum(jnp.where(n_B1 > 0, x, 0.0) * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def gspo(
    *,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    seq_ratio_log_cap: float = 10.0,
    reduction: str = "seq_mean_token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
    delta: float | None = None,
) -> Term:
    """GSPO with the GSPO-token gradient form (Zheng et al. 2025, arXiv:2507.18071).

    With ``N_i`` the action tokens of row ``i`` and ``x_t = clip(p_t - q_t, ±max_log_ratio)``::

        log s_i  = Σ_t m_t·x_t / N_i                        (masked mean: padding never enters)
        log s_it = min(sg(log s_i) + p_t - sg(p_t), seq_ratio_log_cap)
        ℓ_t      = -min(s_it·A_t, clip(s_it, lo, hi)·A_t)

    The value of ``s_it`` is the sequence ratio ``s_i``; its gradient is per token,
    ``∂s_it/∂p_t = s_i``. So the gradient is ``-s_i·A·w`` unless the clip is active for the row
    (``A > 0, s_i > hi`` or ``A < 0, s_i < lo``) or ``log s_i`` exceeds the cap, where it is
    exactly 0; on-policy it is ``-A·w``. This is verl/SkyRL ``gspo`` and Tunix ``gspo-token``;
    with a per-row advantage it has the gradient of TRL's ``importance_sampling_level=
    "sequence"``. The default reduction is ``seq_mean_token_mean``, which verl and SkyRL force.
    The Fireworks cookbook's ``main`` client averages ``p - q`` over the *unmasked* response
    slice (padding and masked tokens leak into ``s_i``); this term does not.

    With ``reduction="token_sum"`` this is the Fireworks built-in ``gspo`` kernel as the SDK
    reference infers it (the kernel is not public): a token sum with the sequence ratio taken
    over the datum's action tokens. Because ``ℓ_t`` is positively homogeneous in ``A_t`` and
    ``s_i`` does not depend on ``A``, folding any reduction's weights into the advantages is
    exact, so `losses.builtin_twin` maps every reduction (an assumption to re-check if the kernel
    turns out to divide by the response length, as the cookbook's algorithm-module revision
    suggests).

    **TRL GSPO-token** (``trl/experimental/gspo_token``, ``importance_sampling_level=
    "sequence_token"``; docs/sources.md#newer-objectives) is this term with no ``≤ 10`` clamp: take
    ``seq_ratio_log_cap ≥ max_log_ratio`` (e.g. 20), which never binds because ``log s_i`` is a
    mean of log-ratios clamped to ``±max_log_ratio``; TRL's ``delta`` is the ``delta`` keyword.
    With ``delta = δ`` the unclipped branch uses ``min(s_it, δ)`` (as `losses.grpo`): the
    gradient is also 0 for ``A > 0, s_i > δ`` and ``A < 0, s_i > max(hi, δ)``.

    Args:
      clip_low_threshold: lower bound ``lo ∈ [0, 1]`` on ``s`` (default ``1 - 3e-4``).
      clip_high_threshold: upper bound ``hi ≥ 1`` on ``s`` (default ``1 + 4e-4``).
      clip_low: alternatively ``ε_lo ∈ [0, 1]`` (default 3e-4, the GSPO paper / TRL recipe).
      clip_high: alternatively ``ε_hi ≥ 0`` (default 4e-4).
      seq_ratio_log_cap: upper clamp of ``log s_it`` (verl/Tunix/Fireworks: 10).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of each token's ``p - q`` before it enters the mean.
      correction: optional `losses.mismatch_correction`.
      delta: TRL's cap ``δ > 1`` of the unclipped sequence ratio; None = off.

    Returns:
      A `Term`; ``config`` holds the absolute thresholds. Metrics add ``seq_ratio_mean`` (mean
      ``s_i`` over rows with an action token), ``clip_frac_low``, ``clip_frac_high`` and
      ``cap_frac`` (action tokens whose gradient each zeroes).
    """
    where = "gspo"
    cap = check_number(where, "seq_ratio_log_cap", seq_ratio_log_cap, low=0.0, low_open=True)
    return _sequence_ratio_term(
        where,
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        cap=cap,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=max_log_ratio,
        correction=correction,
        delta=delta,
    )


def luspo(
    *,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    reduction: str = "seq_mean_token_sum",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
    delta: float | None = None,
) -> Term:
    """LUSPO: the GSPO sequence loss scaled by the row's length (TRL ``loss_type="luspo"``).

    Length-Unbiased Sequence Policy Optimization (TRL ``grpo_trainer.py``, after PR #6654;
    docs/sources.md#newer-objectives) multiplies GSPO's per-sequence loss ``ℓ_i = -min(s_i·A_i,
    clip(s_i, lo, hi)·A_i)`` by ``N_i`` and averages over sequences::

        L = (1/N) Σ_i N_i·ℓ_i = (1/N) Σ_i Σ_t m_it·ℓ_i         (N = rows with a token)

    which is GSPO's per-token loss under the ``seq_mean_token_sum`` reduction (the default
    here), with the GSPO-token gradient ``∂L/∂p_t = -s_i·A/N`` where the clip is inactive and 0
    where it is active — the gradient of TRL's sequence-level ratio when ``A`` is per row. As
    in TRL there is no ``≤ 10`` clamp on ``log s_i`` (each token's ``p - q`` is clamped to
    ``±max_log_ratio``). Example (§3.2): ``p - q = [0.1, 0.3]``, ``A = 1``, ``ε = 0.2``: ``s =
    e^0.2 = 1.2214``, ``L = -min(1.2214, 1.2)·2 = -2.4`` with gradient 0 (clip active).

    Departures: TRL before PR #6654 took ``mean((ℓ·N_i))`` over the padded ``[B, T]`` array
    without the mask (weighting each sequence by ``N_i²/T`` and leaking padding); the default
    clip offsets are GSPO's (3e-4/4e-4), not TRL's generic ``epsilon = 0.2``. With per-token
    advantages the gradient is GSPO-token's (``-s_i·A_t`` per token), not TRL's (which needs a
    per-row ``A``).

    Args:
      clip_low_threshold: lower bound ``lo ∈ [0, 1]`` on ``s`` (default ``1 - 3e-4``).
      clip_high_threshold: upper bound ``hi ≥ 1`` on ``s`` (default ``1 + 4e-4``).
      clip_low: alternatively ``ε_lo ∈ [0, 1]`` (default 3e-4).
      clip_high: alternatively ``ε_hi ≥ 0`` (default 4e-4).
      reduction: one of ``losses.REDUCTIONS``; LUSPO's own aggregation is the default
        ``seq_mean_token_sum`` (any other makes it an uncapped `gspo`).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of each token's ``p - q`` before it enters the mean.
      correction: optional `losses.mismatch_correction`.
      delta: TRL's cap ``δ > 1`` of the unclipped sequence ratio; None = off.

    Returns:
      A `Term` with `gspo`'s metrics. `losses.builtin_twin`: the Fireworks ``gspo`` kernel
      (inferred) with ``seq_ratio_log_cap = 20``, which never binds — the reference's "LUSPO =
      GSPO with ``A_i·N_i``": the reduction's weights fold into the advantages.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> batch = losses.Batch(action_mask=jnp.ones((1, 2)), advantages=jnp.array([1.0]),
      ...                      sampling_logprobs=jnp.array([[-1.1, -1.3]]))
      >>> loss, _ = losses.luspo(clip_low=0.2, clip_high=0.2)(jnp.array([[-1.0, -1.0]]), batch)
      >>> round(float(loss), 6)
      -2.4
    """
    return _sequence_ratio_term(
        "luspo",
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        cap=None,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=max_log_ratio,
        correction=correction,
        delta=delta,
    )


def _sequence_ratio_term(
    where,
    *,
    clip_low_threshold,
    clip_high_threshold,
    clip_low,
    clip_high,
    cap,
    reduction,
    max_tokens,
    max_log_ratio,
    correction,
    delta,
) -> Term:
    """`gspo` (``cap`` a number) and `luspo` (``cap=None``: no clamp of ``log s_it``)."""
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    lo, hi = ratio_bounds(
        where,
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        default_thresholds=(1.0 - GSPO_DEFAULT_OFFSETS[0], 1.0 + GSPO_DEFAULT_OFFSETS[1]),
        default_offsets=GSPO_DEFAULT_OFFSETS,
    )
    if delta is not None:
        delta = check_number(where, "delta", delta, low=1.0, low_open=True)
    # The delta cap has no kernel key: it is a dual clip only for A < 0.
    high = hi if delta is None else min(hi, delta)
    dual = None if delta is None else max(hi, delta)

    def per_token(*, logprobs, log_ratio, adv, valid, **_):
        dtype = log_ratio.dtype
        m = valid.astype(dtype)
        log_s, n = _row_mean(jax.lax.stop_gradient(log_ratio), m)  # [B, 1]
        log_s_tok = log_s + (logprobs - jax.lax.stop_gradient(logprobs))
        if cap is not None:
            log_s_tok = jnp.minimum(log_s_tok, cap)
        terms = ppo_clip_terms(log_s_tok, adv, ratio_low=lo, ratio_high=hi, delta=delta)
        s = jnp.exp(log_s if cap is None else jnp.minimum(log_s, cap))
        extra = {
            "seq_ratio_mean": _active_row_mean(jnp.exp(log_s), n),
            "clip_frac_low": (valid & (adv < 0) & (s < lo)).astype(dtype),
            "clip_frac_high": (valid & (adv > 0) & (s > high)).astype(dtype),
            "cap_frac": (valid & (log_s > cap)).astype(dtype)
            if cap is not None
            else jnp.zeros_like(log_ratio),
        }
        if dual is not None:
            extra["delta_frac"] = (valid & (adv < 0) & (s > dual)).astype(dtype)
        return terms, extra

    config = dict(clip_low_threshold=lo, clip_high_threshold=hi)
    if cap is not None:
        config["seq_ratio_log_cap"] = cap
    config["delta"] = delta
    # LUSPO has no clamp: the kernel's cap at 20 (= every twin's max_log_ratio) never binds.
    kernel_cap = TWIN_MAX_LOG_RATIO if cap is None else cap
    return policy_term(
        name=where,
        kind=where,
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=config,
        correction=correction,
        twin=None
        if delta is not None
        else Twin(
            "gspo",
            {"clip_low_threshold": lo, "clip_high_threshold": hi, "seq_ratio_log_cap": kernel_cap},
            provenance="inferred",
        ),
    )


def gmpo(
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    reduction: str = "seq_mean_token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """GMPO: a geometric-mean sequence ratio with a sign-aware log-space clip (verl ``geo_mean``).

    Geometric-Mean Policy Optimization (Zhao et al. 2025) maximizes the geometric mean of the
    token ratios instead of their arithmetic mean. With ``x_t = clip(p_t - q_t,
    ±max_log_ratio)`` and ``N_i`` the action tokens of row ``i`` (docs/sources.md
    §3.7)::

        x̃_t = min(x_t, clip_high)   if A_t > 0     (= sgn(A)·min(sgn(A)·x, sgn(A)·clip(x, -lo, hi)))
        x̃_t = max(x_t, -clip_low)   if A_t < 0
        x̃_t = 0                      if A_t = 0
        ρ_i = exp(Σ_t m_t·x̃_t / N_i),   Ā_i = Σ_t m_t·A_t / N_i,   ℓ_i = -Ā_i·ρ_i

    The bounds are **log-space** offsets (verl applies ``clip_ratio_low/high`` to the
    log-ratio; the paper suggests ``e^±0.4``). ``ℓ_i`` is a sequence loss, broadcast to the row's
    action tokens and reduced with the per-token weights ``w``: ``L = Σ_i (Σ_t w_it·c_it)·ℓ_i``.
    With ``seq_mean_token_mean`` (default) that is verl's mean over sequences; with ``token_sum``
    each sequence counts ``N_i`` times. The gradient is ``∂L/∂p_t = -(Σ_s w_is·c_is)·Ā_i·ρ_i /
    N_i`` on tokens whose clip is inactive, exactly 0 where it is active (a log-ratio exactly on
    a bound included); on-policy (``ρ_i = 1``,
    row-constant ``w``) it is ``-Ā_i·w_it`` for tokens with ``A_t ≠ 0``. Unlike verl, each token's
    log-ratio is clamped to ``±max_log_ratio`` before the mean (NaN safety).

    Args:
      clip_low: log-space lower offset ``ε_lo ≥ 0`` (default 0.4).
      clip_high: log-space upper offset ``ε_hi ≥ 0`` (default 0.4).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of each token's ``p - q``.
      correction: optional `losses.mismatch_correction`.

    Returns:
      A `Term`. Metrics add ``seq_ratio_mean`` (mean ``ρ_i`` over rows with an action token) and
      ``clip_frac`` (action tokens whose log-ratio the clip holds).
    """
    where = "gmpo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    el = check_number(where, "clip_low", clip_low, low=0.0)
    eh = check_number(where, "clip_high", clip_high, low=0.0)

    def per_token(*, log_ratio, adv, valid, **_):
        dtype = log_ratio.dtype
        m = valid.astype(dtype)
        zero = jnp.zeros((), dtype)
        # ``where``, not ``minimum``/``maximum``: at a log-ratio exactly on a bound those split
        # the gradient in half; here the clip holds there (gradient 0, counted in clip_frac).
        x = jnp.where(
            adv > 0,
            jnp.where(log_ratio < eh, log_ratio, eh),
            jnp.where(adv < 0, jnp.where(log_ratio > -el, log_ratio, -el), zero),
        )
        log_rho, n = _row_mean(x, m)
        abar = _row_mean(adv, m)[0]
        rho = jnp.exp(log_rho)
        loss_B1 = -abar * rho
        terms = jnp.broadcast_to(loss_B1, log_ratio.shape)
        lr = jax.lax.stop_gradient(log_ratio)
        clipped = valid & (((adv > 0) & (lr >= eh)) | ((adv < 0) & (lr <= -el)))
        extra = {"seq_ratio_mean": _active_row_mean(rho, n), "clip_frac": clipped.astype(dtype)}
        return terms, extra

    return policy_term(
        name="gmpo",
        kind="gmpo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(clip_low=el, clip_high=eh),
        correction=correction,
    )


#: VESPO's clamp of the log sequence weight, ``[log 1e-8, 20]``, and of each IS weight.
_VESPO_LOG_W = (math.log(1e-8), 20.0)


def vespo(
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """VESPO: a detached gamma-shaped sequence weight on the REINFORCE gradient (TRL
    ``loss_type="vespo"``, ``get_gamma_weights``).

    Per row ``i`` and action token ``t`` (docs/sources.md#newer-objectives; ``c_t`` the token-level
    mismatch correction's weight, 1 without one)::

        log w_i = clip(Σ_t m·clip(p - q, ±max_log_ratio) + Σ_t m·log clip(c_t, 1e-8, e^20),
                       log 1e-8, 20)
        φ_it    = exp(λ + k·log w_i - λ·w_i)    (k, λ) = (k_pos, λ_pos) if A_t ≥ 0 else (k_neg, λ_neg)
        ℓ_t     = -sg(φ_it)·A_t·p_t

    ``λ`` is clamped at ``≥ 1e-4`` and a non-finite ``φ`` becomes 0, as in TRL. ``φ(1) = 1`` (so
    the on-policy gradient is ``-A·w``) and ``φ`` peaks at ``w = k/λ``. The gradient is
    ``-φ·A·w``: the linear surrogate ``Σ -sg(φ·A·w)·p`` (a ``cross_entropy`` pass with weights
    ``φ·A·w`` once φ is known). Example (§3.2): ``Σ_t (p - q) = 0.3`` gives ``φ = 0.63790`` for
    ``A = +1`` and ``φ = 1.22175`` for ``A = -1``.

    The correction is **folded into** ``w`` (TRL folds its vLLM IS weight in and does not
    multiply it again), so it must be token-level (TRL raises unless the vLLM IS mode is
    ``token_*``): ``tis`` token ≈ ``token_truncate``, ``mis``/``icepop`` token ≈ ``token_mask``.

    Args:
      k_pos: ``k ≥ 0`` for ``A ≥ 0`` (TRL ``vespo_k_pos`` 2.0).
      lambda_pos: ``λ > 0`` for ``A ≥ 0`` (TRL ``vespo_lambda_pos`` 3.0).
      k_neg: ``k ≥ 0`` for ``A < 0`` (TRL ``vespo_k_neg`` 3.0).
      lambda_neg: ``λ > 0`` for ``A < 0`` (TRL ``vespo_lambda_neg`` 2.0).
      reduction: one of ``losses.REDUCTIONS`` (TRL aggregates ``vespo`` like ``dapo``: the
        global token mean, the default).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of each token's ``p - q`` before the sum.
      correction: optional token-level `losses.mismatch_correction` (every rule at
        ``level="token"``), folded into ``w``.

    Returns:
      A `Term` (no built-in twin). Metrics add ``phi_mean`` and ``seq_weight_mean`` (mean ``φ``
      and ``w`` over action tokens).
    """
    where = "vespo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    kp = check_number(where, "k_pos", k_pos, low=0.0)
    lp_ = check_number(where, "lambda_pos", lambda_pos, low=0.0, low_open=True)
    kn = check_number(where, "k_neg", k_neg, low=0.0)
    ln_ = check_number(where, "lambda_neg", lambda_neg, low=0.0, low_open=True)
    corr = as_correction(correction, where)
    if corr is not None:
        bad = [r.kind for r in corr.rules if r.level != "token"]
        if bad:
            raise ValueError(
                f"{where}: the correction must be token-level (it is folded into the sequence "
                f"weight; TRL raises unless the vLLM IS mode is token_*), got rules {bad} at "
                "another level"
            )
    lam_p, lam_n = max(lp_, 1e-4), max(ln_, 1e-4)
    lo_w, hi_w = _VESPO_LOG_W

    def per_token(*, logprobs, log_ratio, adv, valid, correction, **_):
        dtype = log_ratio.dtype
        sg = jax.lax.stop_gradient
        m = valid.astype(dtype)
        c = jnp.clip(jnp.where(valid, sg(correction), 1.0), math.exp(lo_w), math.exp(hi_w))
        log_w = jnp.sum(m * (sg(log_ratio) + jnp.log(c)), axis=1, keepdims=True)
        log_w = jnp.clip(log_w, lo_w, hi_w)
        pos = adv >= 0
        k = jnp.where(pos, kp, kn).astype(dtype)
        lam = jnp.where(pos, lam_p, lam_n).astype(dtype)
        phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
        phi = sg(jnp.where(jnp.isfinite(phi), phi, 0.0))
        w_BT = jnp.broadcast_to(jnp.exp(log_w), log_ratio.shape)
        return -phi * adv * logprobs, {"phi_mean": phi, "seq_weight_mean": w_BT}

    return policy_term(
        name=where,
        kind=where,
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(k_pos=kp, lambda_pos=lp_, k_neg=kn, lambda_neg=ln_),
        correction=corr,
        correction_to_per_token=True,
    )
