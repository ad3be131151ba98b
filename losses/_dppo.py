"""DPPO: policy terms that drop tokens by a divergence between the sampler's and the current
policy's token probabilities — `dppo` (the Fireworks / SkyRL form, a binary TV or KL against
the anchor) and `dppo_tv_kl` (prime-rl's DPPO-Binary-TV with a squared-log-ratio KL, against the
sampler).

Notation as in ``losses/_policy.py``; formulas from docs/sources.md#newer-objectives.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Term, Twin
from losses._common import (
    check_choice,
    check_number,
)
from losses._policy import _common_args, _frac, policy_term

#: The divergences `dppo` selects tokens by.
DIVERGENCES = ("binary_tv", "binary_kl")
#: Fireworks ``dppo`` default thresholds per divergence.
DEFAULT_DPPO_THRESHOLD = {"binary_tv": 0.15, "binary_kl": 0.05}


def binary_divergence(logprobs_BT, anchor_BT, divergence: str) -> jax.Array:
    """DPPO's per-token divergence between Bernoulli(μ = e^q) and Bernoulli(π = e^p).

    ``binary_tv``: ``|μ - π|``. ``binary_kl``: ``μ·log(μ/π) + (1-μ)·log((1-μ)/(1-π))`` with
    both probabilities clipped to ``[eps, 1-eps]`` (``eps`` = the dtype's machine epsilon), so the
    value is finite for any finite input. Stop-gradient (it only selects tokens).
    """
    p = jax.lax.stop_gradient(logprobs_BT)
    q = jax.lax.stop_gradient(anchor_BT)
    pi = jnp.exp(jnp.minimum(p, 0.0))
    mu = jnp.exp(jnp.minimum(q, 0.0))
    if divergence == "binary_tv":
        return jnp.abs(mu - pi)
    eps = jnp.finfo(pi.dtype).eps
    pi = jnp.clip(pi, eps, 1.0 - eps)
    mu = jnp.clip(mu, eps, 1.0 - eps)
    return mu * (jnp.log(mu) - jnp.log(pi)) + (1.0 - mu) * (jnp.log1p(-mu) - jnp.log1p(-pi))


def dppo(
    *,
    divergence: str = "binary_tv",
    threshold: float | None = None,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """DPPO: importance-sampled PG with a divergence trust-region mask (Fireworks ``dppo``).

    Instead of clipping the ratio, DPPO (SkyRL ``dppo``; docs/sources.md#the-policy-family) drops
    the tokens that moved too far *in the improving direction*, measured by a divergence of the
    token's Bernoulli distributions ``μ = e^q`` (anchor) and ``π = e^p`` (current)::

        improving = (A > 0 and r > 1) or (A < 0 and r < 1)
        M = 1 - 1[improving and D(μ, π) > threshold]
        ℓ = -r·A·sg(M)

    ``D`` is ``binary_tv = |μ - π|`` or ``binary_kl = KL(Bern(μ) ‖ Bern(π))``. The gradient is
    ``-r·A·w`` on kept tokens and exactly 0 on dropped ones. Formula *inferred* (Fireworks SDK
    docs/training-api.md#builtin-kernels: the built-in is not public); SkyRL's variant has separate low/high thresholds
    and anchors the ratio on the rollout logprobs (here: on ``old_logprobs``, which defaults to
    the sampling logprobs). With ``reduction="token_sum"`` this is the built-in ``dppo`` kernel.

    Args:
      divergence: ``"binary_tv"`` (default) or ``"binary_kl"``.
      threshold: δ > 0 (≤ 1 for TV); default 0.15 (TV) / 0.05 (KL), the Fireworks defaults.
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction`.

    Returns:
      A `Term`. Metrics add ``mask_frac`` (dropped tokens) and ``divergence_mean``.
    """
    where = "dppo"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    check_choice(where, "divergence", divergence, DIVERGENCES)
    if threshold is None:
        threshold = DEFAULT_DPPO_THRESHOLD[divergence]
    high = 1.0 if divergence == "binary_tv" else None
    delta = check_number(where, "threshold", threshold, low=0.0, low_open=True, high=high)

    def per_token(*, logprobs, anchor, log_ratio, adv, valid, **_):
        div = binary_divergence(logprobs, anchor, divergence)
        lr = jax.lax.stop_gradient(log_ratio)
        improving = ((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0))
        drop = valid & improving & (div > delta)
        keep = jax.lax.stop_gradient(1.0 - drop.astype(log_ratio.dtype))
        terms = -jnp.exp(log_ratio) * adv * keep
        return terms, {"mask_frac": _frac(drop, lr.dtype), "divergence_mean": div}

    return policy_term(
        name="dppo",
        kind="dppo",
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(divergence=divergence, threshold=delta),
        correction=correction,
        twin=Twin("dppo", {"divergence": divergence, "threshold": delta}, provenance="inferred"),
    )


def dppo_tv_kl(
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
) -> Term:
    """prime-rl's default loss: DPPO-Binary-TV masking plus ``kl_tau·(log p/π_roll)²``
    (``src/prime_rl/trainer/rl/loss.py::default_loss_fn``).

    Everything is against the **sampler**, ``μ = batch.sampling_logprobs`` (prime-rl has no
    old-policy recompute): ``r = exp(clip(p - μ, ±max_log_ratio))``, not detached, and with
    ``Δp = e^p - e^μ`` (docs/sources.md#newer-objectives)::

        drop_t = (A > 0 and Δp > mask_high) or (A ≤ 0 and Δp < -mask_low)
        ℓ_t    = -(1 - drop_t)·adv_tau·A·r + kl_tau·(log r)²

    The KL part applies to every action token (dropped ones too). The gradient is
    ``(-(1 - drop)·adv_tau·A·r + 2·kl_tau·log r)·w``. Example (§3.4): ``μ = [0.5]·3``, ``p =
    [0.8, 0.6, 0.25]``, ``A = [1, 1, -1]`` → keep ``[0, 1, 0]``, loss (token sum) ``-1.19927``,
    gradient ``[0.00094, -1.19964, -0.00139]``.

    How it differs from `losses.dppo` (the Fireworks/SkyRL form): separate low/high thresholds
    (prime-rl 0.2/0.2; Fireworks one ``threshold``, 0.15), the sampler anchor (``dppo``:
    ``old_logprobs``), the ``adv_tau`` scale and the KL. The masks agree: for ``binary_tv``,
    ``dppo(threshold=δ)`` drops ``A > 0, Δp > δ`` and ``A < 0, Δp < -δ``, so with ``kl_tau=0``,
    ``adv_tau=1``, ``mask_low = mask_high = δ`` and ``old = sampling`` this is ``dppo`` (whose
    twin is the built-in ``dppo``; this term has none). prime-rl divides each component by its
    own global token count: ``token_mean`` (default) does that for both. Departure: the log-ratio
    is clamped to ``±max_log_ratio`` (prime-rl: none).

    Args:
      mask_low: ``≥ 0``, the drop threshold on ``-Δp`` for ``A ≤ 0`` (``dppo_mask_low`` 0.2).
      mask_high: ``≥ 0``, the drop threshold on ``Δp`` for ``A > 0`` (``dppo_mask_high`` 0.2).
      adv_tau: ``> 0``, the advantage scale (prime-rl 1.0).
      kl_tau: ``≥ 0``, the coefficient of ``(log r)²`` (prime-rl 1e-3).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - μ`` before ``exp``.

    Returns:
      A `Term` reading ``sampling_logprobs`` (not ``old_logprobs``). Metrics add ``mask_frac``
      (dropped tokens) and the KL metrics ``kl`` (mean ``(log r)²``), ``kl_loss``, ``pg_loss``.
    """
    where = "dppo_tv_kl"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    low = check_number(where, "mask_low", mask_low, low=0.0)
    high = check_number(where, "mask_high", mask_high, low=0.0)
    tau = check_number(where, "adv_tau", adv_tau, low=0.0, low_open=True)
    kl_tau = check_number(where, "kl_tau", kl_tau, low=0.0)

    def per_token(*, logprobs, anchor, log_ratio, adv, valid, **_):
        sg = jax.lax.stop_gradient
        dp = jnp.exp(sg(logprobs)) - jnp.exp(sg(anchor))
        drop = valid & (((adv > 0) & (dp > high)) | ((adv <= 0) & (dp < -low)))
        keep = sg(1.0 - drop.astype(log_ratio.dtype))
        terms = -keep * tau * adv * jnp.exp(log_ratio)
        return terms, {"mask_frac": _frac(drop, log_ratio.dtype)}

    return policy_term(
        name=where,
        kind=where,
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(mask_low=low, mask_high=high, adv_tau=tau, kl_tau=kl_tau),
        kl_coef=kl_tau,
        kl_estimator="sq_log_ratio",
        kl_target="sampling_logprobs",
        anchor="sampling_logprobs",
        accepts_correction=False,
    )
