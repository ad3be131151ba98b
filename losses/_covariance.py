"""Covariance-selected policy objectives: Clip-Cov and KL-Cov (verl).

Notation as in ``losses/_policy.py``: ``p`` current logprob (the only differentiable input), ``q``
the anchor (stop-gradient), ``A`` the advantage, ``r = exp(clip(p - q, ±max_log_ratio))``, ``m``
the action mask, ``w`` the reduction's weights; formulas from docs/sources.md#newer-objectives.

**Micro-batch statistics.** Clip-Cov and KL-Cov select tokens by a covariance whose means (and
the selected count) are taken over the valid tokens **of the call**, as verl computes them per
micro-batch (``compute_policy_loss_clip_cov`` / ``_kl_cov``). So ``losses.split_batch`` is *not*
exact for them: each micro-batch is the term on that micro-batch alone (with the full batch's
normalizers), and the sum over micro-batches equals the full-batch loss only when the selection
does not depend on the statistics (e.g. ``kl_cov_ratio=1``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from losses._batch import Batch, Term, count
from losses._common import (
    check_number,
    ppo_clip_terms,
)
from losses._policy import _common_args, _frac, policy_term, ratio_bounds

#: The ``Batch.extra`` entry Clip-Cov folds into its PRNG key when present (a 0-d integer).
RNG_FIELD = "rng"


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
