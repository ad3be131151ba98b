"""The critic: GAE over token-level rewards, masked whitening, and the clipped value loss.

Everything here works on padded ``[B, T]`` target-aligned arrays (docs/conventions.md#data-conventions) with a 0/1
``mask`` (``action_mask``: the tokens the policy generated). Masked positions may hold any value
(``nan``, ``±inf``): every function selects with ``where`` before any arithmetic, so they never
leak into a result or a gradient.

Sources (docs/sources.md#critic-and-advantage-estimators): verl ``verl/trainer/ppo/core_algos.py``
(``compute_gae_advantage_return``, ``compute_value_loss``) and ``verl/utils/torch_functional.py``
(``masked_whiten``); OpenRLHF ``openrlhf/models/loss.py`` (``ValueLoss``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, Term, count, reduction_reads, require
from losses._common import check_number, masked_mean, safe
from losses._reductions import term_weights, validate_reduction


def token_arrays(where: str, **arrays: Any) -> list[jax.Array]:
    """Converts ``[B, T]`` arrays to jax floats and checks rank 2 and equal shapes (eagerly).

    The first array fixes the shape; integer or bool arrays (masks) become float32.
    """
    out, shape = [], None
    for name, value in arrays.items():
        x = jnp.asarray(value)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.float32)
        if x.ndim != 2:
            raise ValueError(f"{where}: {name} must be rank 2 [B, T], got shape {tuple(x.shape)}")
        if shape is None:
            shape, first = tuple(x.shape), name
        elif tuple(x.shape) != shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(x.shape)}, expected {shape} like {first}"
            )
        out.append(x)
    return out


def _unit(where: str, name: str, value: Any) -> float:
    return check_number(where, name, value, low=0.0, high=1.0)


def gae(rewards: Any, values: Any, mask: Any, *, gamma: float, lam: float):
    """Generalized advantage estimation over token rewards, skipping masked tokens (verl's rule).

    Run backwards over ``t`` (``jax.lax.scan``, ``reverse=True``) with ``V_next = 0`` and
    ``A_next = 0`` after the last position::

        δ_t = r_t + γ·V_next − V_t
        A_t = δ_t + γλ·A_next
        (V_next, A_next) ← (V_t, A_t)          only where m_t = 1

    A position with ``m_t = 0`` (an observation token in the middle, or padding) is **skipped**:
    its reward and value are ignored and ``V_next`` and ``A_next`` are carried through it
    unchanged (no discount across the span). This is verl ``compute_gae_advantage_return``
    (Schulman et al. 2015, arXiv:1506.02438). OpenRLHF ``get_advantages_and_returns`` instead
    zeroes ``V`` and ``r`` there and decays by γλ across the span; SkyRL runs the plain
    recursion on the raw values (docs/sources.md#critic-and-advantage-estimators: at λ = 0.5 with the middle
    token masked the three give [0.35, ·, 0.3], [−0.075, 0.85, 0.3], [4.425, −8.15, 0.3]).

    Outputs on masked positions are exactly 0 — verl returns the carried ``A_next`` there (and
    ``A + V``), values that no masked loss reads. ``returns = A + V`` on unmasked tokens, 0
    elsewhere. No whitening happens here (verl whitens afterwards): use `masked_whiten`.

    Args:
      rewards: token-level rewards ``r``; float[B, T] (e.g. the outcome reward at the last
        action token, minus ``β·KL`` per token).
      values: the critic's values ``V`` at collection time; float[B, T].
      mask: 1.0 on the tokens that count (``action_mask``), else 0.0; float[B, T].
      gamma: discount ``γ ∈ [0, 1]`` (verl/OpenRLHF default 1); a static Python float.
      lam: GAE ``λ ∈ [0, 1]`` (verl/OpenRLHF default 1); a static Python float.

    Returns:
      ``(advantages, returns)``, each float[B, T], 0 on masked positions.

    Example:
      >>> import losses
      >>> adv, ret = losses.gae([[0., 0., 1.]], [[0.5, 9.0, 0.7]], [[1., 0., 1.]], gamma=1.0,
      ...                       lam=0.5)
      >>> [round(float(a), 4) for a in adv[0]], [round(float(r), 4) for r in ret[0]]
      ([0.35, 0.0, 0.3], [0.85, 0.0, 1.0])
    """
    where = "gae"
    gamma = _unit(where, "gamma", gamma)
    lam = _unit(where, "lam", lam)
    r, v, m = token_arrays(where, rewards=rewards, values=values, mask=mask)
    dtype = jnp.result_type(r.dtype, v.dtype)
    valid = m > 0
    r = safe(r.astype(dtype), valid)
    v = safe(v.astype(dtype), valid)

    def step(carry, xs):
        next_value, next_adv = carry
        r_t, v_t, valid_t = xs
        delta = r_t + gamma * next_value - v_t
        adv = delta + (gamma * lam) * next_adv
        carry = (jnp.where(valid_t, v_t, next_value), jnp.where(valid_t, adv, next_adv))
        return carry, jnp.where(valid_t, adv, jnp.zeros((), dtype))

    zeros = jnp.zeros(r.shape[:1], dtype)
    _, adv_TB = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T), reverse=True)
    adv = adv_TB.T
    returns = safe(adv + v, valid)
    return adv, returns


def masked_whiten(x: Any, mask: Any, *, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
    """Whitens ``x`` over the masked entries of the whole array (verl ``masked_whiten``).

    With ``n = Σ m``, ``μ = Σ m·x / n`` and the **unbiased** variance
    ``σ² = Σ m·(x − μ)² / (n − 1)`` (Bessel-corrected, as verl's ``masked_var``)::

        y = (x − μ)·rsqrt(σ² + eps)          (+ μ when shift_mean=False)

    on masked entries, and exactly 0 elsewhere (verl whitens every entry; the masked ones are
    never read). Where verl raises (``n = 0`` or ``n = 1``) this returns zeros for ``n = 0`` and
    uses ``σ² = 0`` for ``n = 1`` (so ``y = 0``, or ``μ`` with ``shift_mean=False``): jittable,
    no data-dependent error. Masked entries may hold inf/nan.

    Args:
      x: values to whiten; float[...] (any shape, e.g. [B, T] advantages).
      mask: 1.0 on the entries that count, else 0.0; same shape as ``x``.
      shift_mean: if False, add ``μ`` back (verl's ``shift_mean``); default True.
      eps: ``> 0`` added to the variance (verl 1e-8).

    Returns:
      The whitened array, same shape as ``x``, 0 where ``mask`` is 0.

    Example:
      >>> import losses
      >>> [round(float(a), 5) for a in losses.masked_whiten([1., 1, 1, 0, 0, 0], [1.] * 6)]
      [0.91287, 0.91287, 0.91287, -0.91287, -0.91287, -0.91287]
    """
    where = "masked_whiten"
    if not isinstance(shift_mean, bool):
        raise ValueError(f"{where}: shift_mean must be a bool, got {shift_mean!r}")
    eps = check_number(where, "eps", eps, low=0.0, low_open=True)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    m = jnp.asarray(mask)
    if tuple(m.shape) != tuple(x.shape):
        raise ValueError(
            f"{where}: mask has shape {tuple(m.shape)}, expected {tuple(x.shape)} like x"
        )
    valid = m > 0
    x = safe(x, valid)
    n = count(valid.astype(x.dtype)).astype(x.dtype)
    mean = jnp.sum(x) / jnp.maximum(n, 1.0)
    centered = safe(x - mean, valid)
    var = jnp.sum(centered * centered) / jnp.maximum(n - 1.0, 1.0)
    y = centered * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return safe(y, valid)


def value_loss(
    *,
    clip: float | None = 0.5,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
) -> Term:
    """PPO clipped value loss; its differentiable input is the value predictions, not logprobs.

    The term's first argument is the critic's current predictions ``v`` (float[B, T], one per
    target-aligned token, as a value head gives them), in the place where policy terms take
    ``logprobs``; ``jax.grad`` is taken with respect to it. With ``v_old = batch.old_values``,
    ``R = batch.returns`` (e.g. `gae` returns) and ``w`` the reduction's weights over
    ``action_mask``::

        v_clip = clip(v, v_old − c, v_old + c)
        L      = ½·Σ w·max((v − R)², (v_clip − R)²)

    the pessimistic max of verl ``compute_value_loss`` (``cliprange_value`` 0.5, ``agg_loss``)
    and OpenRLHF ``ValueLoss`` (``--critic.value_clip`` 0.5). ``clip=None`` is the unclipped
    ``½·Σ w·(v − R)²`` (OpenRLHF ``clip_eps=None``; ``old_values`` is then not read). The gradient
    is ``w·(v − R)`` where the unclipped loss is the max, and exactly 0 where the clipped loss is
    strictly larger (``v`` beyond the band, moving away from ``R``). Masked positions may hold
    inf/nan (zero gradient). The normalizers come from the batch, so `split_batch` is exact. Do
    not `fold` it with policy terms: their first arguments differ.

    Args:
      clip: the clip range ``c > 0`` around ``old_values`` (default 0.5, verl and OpenRLHF);
        ``None`` = unclipped.
      reduction: one of ``losses.REDUCTIONS`` (default ``token_mean``, verl's ``token-mean``).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.

    Returns:
      A `Term` ``(values[B, T], batch) -> (loss, metrics)`` reading ``action_mask``,
      ``returns`` and (when clipped) ``old_values``. Metrics: ``loss``, ``vf_clipfrac`` (verl:
      the fraction of action tokens where the clipped loss is strictly larger), ``vpred_mean``,
      ``returns_mean``, ``num_tokens``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((1, 2)), old_values=jnp.array([[0.5, 0.5]]),
      ...                  returns=jnp.array([[1.0, 0.0]]))
      >>> round(float(losses.value_loss()(jnp.array([[1.2, 0.1]]), b)[0]), 6)
      0.0125
    """
    where = "value_loss"
    validate_reduction(reduction, max_tokens, where=where)
    c = None if clip is None else check_number(where, "clip", clip, low=0.0, low_open=True)
    requires = {"action_mask", "returns"} | ({"old_values"} if c is not None else set())

    def loss_fn(values, batch: Batch):
        v = jnp.asarray(values)
        if v.ndim != 2 or tuple(v.shape) != batch.shape:
            raise ValueError(
                f"{where}: values has shape {tuple(v.shape)}, expected {batch.shape} like "
                "batch.action_mask"
            )
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise ValueError(f"{where}: values must be floating point, got dtype {v.dtype}")
        batch = jax.lax.stop_gradient(batch)
        valid = batch.action_mask > 0
        w = term_weights(batch, "action", reduction, max_tokens)
        v = safe(v, valid)
        ret = safe(require(batch, "returns", where), valid)
        unclipped = jnp.square(v - ret)
        if c is None:
            per_token = unclipped
            clipped_larger = jnp.zeros_like(valid)
        else:
            old = safe(require(batch, "old_values", where), valid)
            clipped = jnp.square(jnp.clip(v, old - c, old + c) - ret)
            clipped_larger = valid & (clipped > unclipped)
            per_token = jnp.where(clipped_larger, clipped, unclipped)
        loss = 0.5 * jnp.sum(w * per_token)
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "vf_clipfrac": masked_mean(clipped_larger.astype(v.dtype), valid),
            "vpred_mean": masked_mean(v, valid),
            "returns_mean": masked_mean(ret, valid),
            "num_tokens": count(valid.astype(v.dtype)),
        }
        return loss, metrics

    return Term(
        name="value_loss",
        fn=loss_fn,
        kind="value_loss",
        config=dict(clip=c, reduction=reduction, max_tokens=max_tokens),
        reads=frozenset(requires) | reduction_reads(reduction, "action"),
        requires=frozenset(requires),
        twin=None,
        argument="values",
    )
