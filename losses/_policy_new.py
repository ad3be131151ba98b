"""Newer policy objectives and the standalone KL term: Clip-Cov, KL-Cov, VESPO, prime-rl's
DPPO-Binary-TV + KL, and `kl_loss` (a KL to the reference or to the sampler, any estimator).

Notation as in ``losses/_policy.py``: ``p`` current logprob (the only differentiable input), ``q``
the anchor (stop-gradient), ``A`` the advantage, ``r = exp(clip(p - q, ±max_log_ratio))``, ``m``
the action mask, ``w`` the reduction's weights; formulas from docs/sources.md#kl-variants (and #newer-objectives).

**Micro-batch statistics.** Clip-Cov and KL-Cov select tokens by a covariance whose means (and
the selected count) are taken over the valid tokens **of the call**, as verl computes them per
micro-batch (``compute_policy_loss_clip_cov`` / ``_kl_cov``). So ``losses.split_batch`` is *not*
exact for them: each micro-batch is the term on that micro-batch alone (with the full batch's
normalizers), and the sum over micro-batches equals the full-batch loss only when the selection
does not depend on the statistics (e.g. ``kl_cov_ratio=1``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from losses._batch import Batch, Term, check_logprobs_shape, count, reduction_reads, require
from losses._common import (
    KL_ESTIMATORS,
    KL_FORMS,
    SAMPLER_KL_FORMS,
    check_choice,
    check_number,
    clamped_log_ratio,
    kl_penalty,
    masked_mean,
    ppo_clip_terms,
)
from losses._correction import as_correction
from losses._per_datum import NORMALIZED
from losses._policy import _common_args, _frac, policy_term, ratio_bounds
from losses._reductions import term_weights

#: The ``Batch.extra`` entry Clip-Cov folds into its PRNG key when present (a 0-d integer).
RNG_FIELD = "rng"
#: The fields a `kl_loss` may compare ``p`` with.
KL_TARGETS = ("ref_logprobs", "sampling_logprobs")
#: VESPO's clamp of the log sequence weight, ``[log 1e-8, 20]``, and of each IS weight.
_VESPO_LOG_W = (math.log(1e-8), 20.0)


# -- covariance selection -------------------------------------------------------------------------


def _covariance(adv_BT, logprobs_BT, valid_BT):
    """``(A - mean A)·(sg(p) - mean sg(p))`` with masked means over the call's valid tokens."""
    dtype = logprobs_BT.dtype
    m = valid_BT.astype(dtype)
    n = count(m)
    lp = jax.lax.stop_gradient(logprobs_BT)
    mean_a = jnp.sum(adv_BT * m) / jnp.maximum(n, 1.0)
    mean_lp = jnp.sum(lp * m) / jnp.maximum(n, 1.0)
    return jnp.where(valid_BT, (adv_BT - mean_a) * (lp - mean_lp), 0.0), n


def _first_k(eligible_BT, key_BT, k, k_max: int):
    """The ``k`` eligible tokens with the smallest ``key`` (ties: the lower row-major index).

    ``k`` may be a traced 0-d count, at most the static ``k_max`` (at most the number of
    eligible tokens are chosen). One ``lax.top_k`` of ``k_max`` over the flattened tokens, not a
    full sort: at ``k_max ≪ B·T`` (Clip-Cov / KL-Cov's ratios of 2e-4) that is the difference
    between ~1x and ~40x a GRPO step. ``top_k`` orders equal values by lower index, the tie
    rule; ``+ 0.0`` maps ``-0.0`` to ``0.0`` so that signed zeros tie.
    """
    shape = eligible_BT.shape
    flat_ok = eligible_BT.reshape(-1)
    score = jnp.where(flat_ok, -key_BT.reshape(-1) + 0.0, -jnp.inf)
    vals, idx = jax.lax.top_k(score, k_max)
    take = (jnp.arange(k_max) < k) & (vals > -jnp.inf)
    return jnp.zeros(flat_ok.shape, bool).at[idx].set(take).reshape(shape)


def _k_max(ratio: float, shape) -> int:
    """A static bound on `_count_k` over a ``shape`` batch (``+1``: float rounding of ``k``)."""
    size = int(np.prod(shape))
    return max(1, min(size, int(ratio * size) + 1))


def _uniform_keys(bits, dtype):
    """Random bits as floats in [0, 1) (24 bits: exact in float32), for `_first_k`."""
    return (bits >> 8).astype(dtype) * (2.0**-24)


def _mix32(h):
    """The murmur3 32-bit finalizer: a bijective avalanche mix of uint32 values."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _position_bits(key, shape):
    """uint32 random bits per position, a hash of ``(key, row, column)``: the same token gets
    the same bits whatever the padding (padding rows/columns only add positions). A counter-based
    hash (two murmur3 finalizer rounds keyed by the JAX key's data), elementwise and cheap: a
    per-position ``fold_in`` costs ~7x a GRPO step at B=256, T=4096."""
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    rows = jnp.arange(shape[0], dtype=jnp.uint32)[:, None]
    cols = jnp.arange(shape[1], dtype=jnp.uint32)[None, :]
    h = _mix32(rows * jnp.uint32(0x9E3779B1) ^ words[0])
    return _mix32(h ^ (cols * jnp.uint32(0x7FEB352D) + words[-1]))


def _count_k(ratio: float, n):
    """``max(⌊ratio·n⌋, 1)`` (verl: ``max(int(ratio·N), 1)``), 0 without valid tokens."""
    return jnp.where(n > 0, jnp.maximum(jnp.floor(ratio * n), 1.0), 0.0)


def _check_rng_extra(batch: Batch, logprobs: Any) -> None:
    """`Term.validate` of `clip_cov`: ``extra["rng"]``, when present, is a 0-d integer ≥ 0."""
    del logprobs
    value = batch.extra.get(RNG_FIELD)
    if value is None:
        return
    v = np.asarray(value)
    if v.shape != () or not np.isfinite(v) or v < 0 or v != np.floor(v) or v >= 2**24:
        raise ValueError(
            f"clip_cov: Batch extra field '{RNG_FIELD}' must be a 0-d integer in [0, 2^24) "
            f"(a step counter; Batch stores it as float), got {value!r}"
        )


def clip_cov(
    *,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    seed: int = 0,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """Clip-Cov: PPO with a random few high-covariance tokens detached (Cui et al. 2025, "The
    Entropy Mechanism of RL for Reasoning LMs"; verl ``compute_policy_loss_clip_cov``).

    Per valid token of the call (docs/sources.md#newer-objectives)::

        ℓ_t   = max(-A·r, -A·clip(r, lo, hi))                        (PPO, no dual clip)
        cov_t = (A_t - mean A)·(sg(p_t) - mean sg(p))                 (means over the call)
        C     = {t valid, PPO clip inactive, lb < cov_t < ub}        (strict bounds)
        Z     = a uniformly random subset of C of size min(|C|, max(⌊ratio·N⌋, 1))
        ℓ_t  ← 0 for t ∈ Z                                           (value and gradient)

    with ``N`` the call's valid tokens. The gradient is PPO's (``-r·A·w`` inside the trust
    region, 0 where the clip is active) except on ``Z``, where it is exactly 0. The bounds are on
    the raw covariance scale, so they depend on the scale of ``A``.

    **Randomness as data.** ``Z`` is drawn from ``key = fold_in(jax.random.key(seed),
    batch.extra["rng"])`` (the ``extra`` entry is optional: pass e.g. the step number to draw a
    new subset each step without recompiling; without it the key is ``key(seed)``). Each token's
    priority comes from ``fold_in(fold_in(key, row), column)``, so the selection is the same
    under padding and jit/vmap, and changes with a row permutation. verl uses torch's
    global RNG (``torch.randperm``).

    **Not micro-batch exact**: the means, ``N`` and the row indices are the call's (module
    docstring); the reduction's normalizers are carried as usual.

    Departures from verl: the log-ratio is clamped to ``±max_log_ratio`` before ``exp`` (verl:
    no clamp); the subset is drawn from a JAX key, not torch's RNG.

    Args:
      clip_low_threshold: absolute lower ratio bound ``lo ∈ [0, 1]`` (default 0.8).
      clip_high_threshold: absolute upper ratio bound ``hi ≥ 1`` (default 1.2).
      clip_low: alternatively ``ε_lo ∈ [0, 1]`` (verl ``clip_ratio_low``, default 0.2).
      clip_high: alternatively ``ε_hi ≥ 0`` (verl ``clip_ratio_high``, default 0.2).
      clip_cov_ratio: the fraction ``∈ (0, 1]`` of valid tokens to detach (verl 2e-4).
      clip_cov_lb: strict lower covariance bound (verl 1.0).
      clip_cov_ub: strict upper covariance bound ``> clip_cov_lb`` (verl 5.0).
      seed: the PRNG seed ``∈ [0, 2^32)``; ``batch.extra["rng"]`` is folded into it.
      reduction: one of ``losses.REDUCTIONS`` (verl default ``token-mean``).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction` (multiplies ``ℓ``).

    Returns:
      A `Term` (no built-in twin). Metrics add ``cov_zeroed_frac`` (``|Z|/N``, verl
      ``pg_clipfrac``), ``cov_candidate_frac`` (``|C|/N``), ``clip_frac_low``/``clip_frac_high``
      (PPO clip active) and ``cov_mean``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> lp = jnp.array([[-0.5, -3.0, -1.0, -3.0]])    # docs/sources.md#newer-objectives: on-policy
      >>> batch = losses.Batch(action_mask=jnp.ones((1, 4)), sampling_logprobs=lp,
      ...                      advantages=jnp.array([[2.0, 2.0, -2.0, -2.0]]))
      >>> _, metrics = losses.clip_cov(reduction="token_sum")(lp, batch)
      >>> float(metrics["cov_zeroed_frac"]), float(metrics["cov_candidate_frac"])  # one of {0, 3}
      (0.25, 0.5)
    """
    where = "clip_cov"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    lo, hi = ratio_bounds(
        where,
        clip_low_threshold=clip_low_threshold,
        clip_high_threshold=clip_high_threshold,
        clip_low=clip_low,
        clip_high=clip_high,
        default_thresholds=(0.8, 1.2),
        default_offsets=(0.2, 0.2),
    )
    ratio = check_number(where, "clip_cov_ratio", clip_cov_ratio, low=0.0, low_open=True, high=1.0)
    lb = check_number(where, "clip_cov_lb", clip_cov_lb)
    ub = check_number(where, "clip_cov_ub", clip_cov_ub)
    if not ub > lb:
        raise ValueError(f"{where}: clip_cov_ub must be > clip_cov_lb, got {ub} <= {lb}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{where}: seed must be an int in [0, 2^32), got {seed!r}")

    def per_token(*, logprobs, log_ratio, adv, valid, batch, **_):
        dtype = log_ratio.dtype
        sg = jax.lax.stop_gradient
        terms = ppo_clip_terms(log_ratio, adv, ratio_low=lo, ratio_high=hi)
        r = sg(jnp.exp(log_ratio))
        clipped = valid & (((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo)))
        cov, n = _covariance(adv, logprobs, valid)
        cand = valid & ~clipped & (cov > lb) & (cov < ub)
        key = jax.random.key(seed)
        rng = batch.extra.get(RNG_FIELD)
        if rng is not None:
            if jnp.ndim(rng) != 0:
                raise ValueError(
                    f"{where}: Batch extra field '{RNG_FIELD}' must be 0-d, got shape "
                    f"{jnp.shape(rng)}"
                )
            key = jax.random.fold_in(key, jnp.asarray(rng).astype(jnp.uint32))
        prio = _uniform_keys(_position_bits(key, valid.shape), dtype)
        zeroed = _first_k(cand, prio, _count_k(ratio, n), _k_max(ratio, valid.shape))
        terms = jnp.where(zeroed, jnp.zeros((), dtype), terms)
        extra = {
            "cov_zeroed_frac": _frac(zeroed, dtype),
            "cov_candidate_frac": _frac(cand, dtype),
            "clip_frac_low": _frac(valid & (adv < 0) & (r < lo), dtype),
            "clip_frac_high": _frac(valid & (adv > 0) & (r > hi), dtype),
            "cov_mean": cov,
        }
        return terms, extra

    term = policy_term(
        name=where,
        kind=where,
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(
            clip_low_threshold=lo,
            clip_high_threshold=hi,
            clip_cov_ratio=ratio,
            clip_cov_lb=lb,
            clip_cov_ub=ub,
            seed=seed,
        ),
        correction=correction,
        pass_batch=True,
        per_datum=False,
    )
    return dataclasses.replace(term, validate=_check_rng_extra)


def kl_cov(
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
    correction: Any = None,
) -> Term:
    """KL-Cov: IS policy gradient plus an ``|p - q|`` penalty on the highest-covariance tokens
    (Cui et al. 2025; verl ``compute_policy_loss_kl_cov``).

    Per valid token of the call (docs/sources.md#newer-objectives)::

        cov_t = (A_t - mean A)·(sg(p_t) - mean sg(p))                 (means over the call)
        K     = the k = max(⌊kl_cov_ratio·N⌋, 1) tokens of largest cov (ties: lower row-major
                index first; torch.topk leaves ties implementation-defined)
        ℓ_t   = -A·r + 1[t ∈ K]·κ·|p - q|

    with ``κ = ppo_kl_coef`` and ``N`` the call's valid tokens. No ratio clip: the gradient is
    ``(-A·r + 1[t ∈ K]·κ·sign(p - q))·w``; on-policy (``p = q``) it is ``-A·w``. Worked example
    (§3.1): ``A = [2, 2, -2, -2]``, ``p = [-0.5, -3, -1, -3]`` → ``cov = [2.75, -2.25, -1.75,
    2.25]``, ``K = {0}``; with ``q_0 = -0.6``: ``ℓ_0 = -2e^{0.1} + 0.1·0.1 = -2.20034`` and
    ``∂ℓ_0/∂p_0 = -2.11034``.

    **Not micro-batch exact** unless ``kl_cov_ratio = 1`` (every token penalised): module
    docstring. Departures from verl: ``p - q`` is clamped to ``±max_log_ratio`` (in ``r`` and the
    penalty); ties are broken deterministically.

    Args:
      kl_cov_ratio: the fraction ``∈ (0, 1]`` of valid tokens penalised (verl 2e-4; SkyRL
        ``kl_cov_frac`` 0.2).
      ppo_kl_coef: ``κ ≥ 0`` (verl YAML 0.1, code fallback 1.0; SkyRL 1.0).
      reduction: one of ``losses.REDUCTIONS`` (verl default ``token-mean``).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` before ``exp``.
      correction: optional `losses.mismatch_correction` (multiplies ``ℓ``).

    Returns:
      A `Term` (no built-in twin). Metrics add ``kl_cov_frac`` (``|K|/N``), ``abs_log_ratio``
      (mean ``|p - q|``, verl ``ppo_kl_abs``) and ``cov_mean``.
    """
    where = "kl_cov"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    ratio = check_number(where, "kl_cov_ratio", kl_cov_ratio, low=0.0, low_open=True, high=1.0)
    kappa = check_number(where, "ppo_kl_coef", ppo_kl_coef, low=0.0)

    def per_token(*, logprobs, log_ratio, adv, valid, **_):
        dtype = log_ratio.dtype
        cov, n = _covariance(adv, logprobs, valid)
        chosen = _first_k(valid, -cov, _count_k(ratio, n), _k_max(ratio, valid.shape))
        # κ·|p - q| with the subgradient sign(0) = 0, as torch (jnp.abs has 1 at 0).
        abs_lr = log_ratio * jax.lax.stop_gradient(jnp.sign(log_ratio))
        penalty = jnp.where(chosen, kappa * abs_lr, jnp.zeros((), dtype))
        terms = -adv * jnp.exp(log_ratio) + penalty
        extra = {
            "kl_cov_frac": _frac(chosen, dtype),
            "abs_log_ratio": jnp.abs(log_ratio),
            "cov_mean": cov,
        }
        return terms, extra

    return policy_term(
        name=where,
        kind=where,
        per_token=per_token,
        reduction=reduction,
        max_tokens=max_tokens,
        max_log_ratio=mlr,
        config=dict(kl_cov_ratio=ratio, ppo_kl_coef=kappa),
        correction=correction,
        # The top-k tokens are chosen over the whole batch, unless every token is penalised.
        per_datum=ratio == 1.0,
    )


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


def kl_loss(
    *,
    coef: float = 1.0,
    estimator: str = "k3",
    target: str = "ref_logprobs",
    score_function: bool = False,
    importance_weight: bool = False,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
) -> Term:
    """A per-token KL term on its own: ``L = coef·Σ_{i,t} w_{i,t}·[r·] k(p, target)_{i,t}``.

    Fold it with any policy term (``losses.fold(losses.dapo(), ("kl", losses.kl_loss(coef=1e-3,
    estimator="k3", importance_weight=True)))``) to give that term a KL penalty; `losses.grpo`
    and `losses.reinforce` also take the reference KL as keywords (``kl_coef``, ...). ``δ = clip(p
    - target, ±max_log_ratio)``, ``ρ = e^δ``, ``r = exp(clip(p - old, ±max_log_ratio))``. Per
    token, value and gradient (docs/sources.md#kl-variants; the §2.3 example, ``p = log[0.5, 0.2]``,
    ``ref = log[0.4, 0.4]``, ``old = roll = log[0.4, 0.25]``, in the last column):

    ==========================  ===============  ===============  ================================
    ``estimator`` (+ flags)     value            ``∂/∂p``         §2.3 ∂/∂p
    ==========================  ===============  ===============  ================================
    ``k1``                      δ                1                [1, 1]
    ``k2``                      δ²/2             δ                [0.22314, -0.69315]
    ``k3``                      e^{-δ} + δ - 1   1 - e^{-δ}       [0.2, -1.0]
    ``k3`` + score_function     k3               δ                verl ``k3+``: [0.22314, ...]
    ``k3`` + importance_weight  r·k3             r·δ              TRL/slime: [0.27893, -0.55452]
    ``k1`` + importance_weight  r·δ              r·(δ + 1)        slime ``r·k1``: [1.52893, 0.24548]
    any + both flags            r·k              sg(r)·δ          OpenRLHF #1309: [0.27893, ...]
    ``sq_log_ratio`` (sampler)  δ²               2δ               prime-rl: [0.44629, -0.44629]
    ``rllm_bwd`` (sampler)      ρ - 1 - δ        ρ - 1            rllm approx: [0.25, -0.2]
    ``rllm_bwd_sf`` (sampler)   ρ - 1 - δ        -1               rllm ``kl_approx=False``
    ``rllm_fwd`` (sampler)      ρ·δ - ρ + 1      ρ·δ              rllm (both): [0.27893, -0.17851]
    ==========================  ===============  ===============  ================================

    What each descends in expectation (§2.1, tokens from ``p`` on-policy, from the anchor
    ``μ`` with ``importance_weight``): ``k1`` nothing (zero-mean gradient); ``k2`` on-policy,
    ``k1``/``k3`` + ``score_function`` on-policy, ``r·k3``, ``r·k1`` and both flags: the reverse
    ``∇KL(p‖ref)``; ``k3``: the forward ``∇KL(ref‖p)`` (biased); ``r·k2``: biased. The sampler
    forms take ``target="sampling_logprobs"`` and tokens drawn by the sampler ``μ``:
    ``rllm_bwd``/``rllm_bwd_sf`` descend ``∇KL(μ‖p)``, ``rllm_fwd`` ``∇KL(p‖μ)`` (rllm calls
    this one "forward": the naming trap of §2.2), and ``sq_log_ratio`` is prime-rl's trust region
    toward ``μ`` (its expected gradient ``2·E_μ[log(p/μ)·∇p]`` is not a KL gradient).

    Departure: for ``rllm_bwd_sf`` rllm's loss *value* is ``-p`` (and ``sg(ρ·δ)·p`` for its
    ``kl_approx=False`` forward form); here the value is the KL estimate ``ρ - 1 - δ`` and the
    gradient is rllm's, so ``rllm_fwd`` covers both of rllm's forward forms. With both flags the
    value is ``r·k`` (OpenRLHF reports ``k`` clamped to ±10 and caps ``sg(r)`` at 10).

    Args:
      coef: the coefficient ``≥ 0`` (0: `Term.is_zero`, left out of a fold's sum).
      estimator: one of `losses.KL_FORMS` (``KL_ESTIMATORS`` for the reference;
        ``SAMPLER_KL_FORMS`` need ``target="sampling_logprobs"``).
      target: ``"ref_logprobs"`` (default) or ``"sampling_logprobs"``.
      score_function: keep the value, take the score-function gradient ``δ`` (``k1``-``k3``
        only); with ``k1`` this is the unbiased score-function k1 form (k1 in the reward).
      importance_weight: multiply by ``r = exp(p - old)``, not detached (detached with
        ``score_function``); reads ``old_logprobs``.
      reduction: one of ``losses.REDUCTIONS`` over ``action_mask``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - target`` and ``p - old``.

    Returns:
      A `Term` (no twin: KL is client-only). Metrics: ``loss``, ``kl`` (mean per-token estimate
      over action tokens, weighted by ``r`` when ``importance_weight``), ``num_tokens``.

    Example:
      >>> import jax, jax.numpy as jnp, losses
      >>> batch = losses.Batch(action_mask=jnp.ones((1, 2)), sampling_logprobs=jnp.log(
      ...     jnp.array([[0.4, 0.25]])), ref_logprobs=jnp.log(jnp.array([[0.4, 0.4]])))
      >>> term = losses.kl_loss(estimator="k3", importance_weight=True, reduction="token_sum")
      >>> g = jax.grad(lambda x: term(x, batch)[0])(jnp.log(jnp.array([[0.5, 0.2]])))
      >>> [round(float(v), 5) for v in g[0]]
      [0.27893, -0.55452]
    """
    where = "kl_loss"
    mlr = _common_args(where, reduction, max_tokens, max_log_ratio)
    c = check_number(where, "coef", coef, low=0.0)
    check_choice(where, "estimator", estimator, KL_FORMS)
    check_choice(where, "target", target, KL_TARGETS)
    for name, value in (
        ("score_function", score_function),
        ("importance_weight", importance_weight),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be a bool, got {value!r}")
    if estimator in SAMPLER_KL_FORMS and target != "sampling_logprobs":
        raise ValueError(
            f"{where}: estimator {estimator!r} estimates a KL on tokens drawn by the sampler; "
            "it needs target='sampling_logprobs'"
        )
    if score_function and estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"{where}: score_function applies to {KL_ESTIMATORS}, not {estimator!r} (the "
            "sampler forms fix their own gradient)"
        )
    requires = {"action_mask", target} | ({"old_logprobs"} if importance_weight else set())
    reads = frozenset(requires) | reduction_reads(reduction, "action")

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        valid = batch.action_mask > 0
        w = term_weights(batch, "action", reduction, max_tokens)
        iw = None
        if importance_weight:
            iw = clamped_log_ratio(lp, require(batch, "old_logprobs", where), valid, mlr)
        kl_BT = kl_penalty(
            lp,
            require(batch, target, where),
            valid,
            estimator=estimator,
            max_log_ratio=mlr,
            score_function=score_function,
            importance_log_ratio=iw,
        )
        loss = c * jnp.sum(w * kl_BT)
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "kl": masked_mean(kl_BT, valid),
            "num_tokens": count(valid.astype(lp.dtype)),
        }
        return loss, metrics

    return Term(
        name="kl",
        fn=loss_fn,
        kind=where,
        config=dict(
            coef=c,
            estimator=estimator,
            target=target,
            score_function=score_function,
            importance_weight=importance_weight,
            reduction=reduction,
            max_tokens=max_tokens,
            max_log_ratio=mlr,
        ),
        is_zero=c == 0.0,
        reads=reads,
        requires=frozenset(requires),
        per_datum=NORMALIZED,
    )
