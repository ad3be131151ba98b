"""The standalone KL term `kl_loss`: a KL to the reference or to the sampler, any estimator.

Notation as in ``losses/_policy.py``; formulas from docs/sources.md#kl-variants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
)
from losses._per_datum import NORMALIZED
from losses._policy import _common_args
from losses._reductions import term_weights

#: The fields a `kl_loss` may compare ``p`` with.
KL_TARGETS = ("ref_logprobs", "sampling_logprobs")


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
