"""Advantage estimators: group-outcome estimators over ``[B]`` rewards, token-level ones over
``[B, T]``.

* `group_advantages` — per-sequence advantages from outcome rewards ``R_i = Σ_t r_it`` of
  contiguous groups (GRPO, Dr. GRPO, RLOO, GRPO pass@k, MaxRL, TRL batch-scaled, OPO).
* `discounted_returns`, `reinforce_pp_advantages`, `reinforce_pp_baseline_advantages`,
  `remax_advantages` — per-token ``[B, T]`` advantages over ``action_mask`` (0 on masked tokens).
* GAE and `masked_whiten` live in ``_critic.py``.

Formulas, defaults and golden values: docs/sources.md#critic-and-advantage-estimators and docs/sources.md#critic-and-advantage-estimators
(verl ``verl/trainer/ppo/core_algos.py``, SkyRL ``skyrl/backends/skyrl_train/utils/ppo_utils.py``,
TRL ``trl/trainer/grpo_trainer.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from losses._common import check_choice, check_number, safe
from losses._critic import masked_whiten, token_arrays

#: Group estimators that need only the rewards (what a runner config may name).
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "grpo_passk", "maxrl", "trl_batch")
#: Every estimator `group_advantages` accepts: `ESTIMATORS` plus ``"opo"`` (needs ``lengths``).
GROUP_ESTIMATORS = ESTIMATORS + ("opo",)
#: Estimators with a defined singleton rule (``group_size=1`` allowed).
_SINGLETON_OK = ("maxrl", "opo")
#: The ``eps`` each estimator uses by default (verl/SkyRL 1e-6; TRL 1e-4).
DEFAULT_EPS = {"grpo": 1e-6, "grpo_passk": 1e-6, "maxrl": 1e-6, "trl_batch": 1e-4}


def _rewards_B(where: str, rewards: Any) -> jax.Array:
    r = jnp.asarray(rewards)
    if not jnp.issubdtype(r.dtype, jnp.floating):
        r = r.astype(jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"{where}: rewards must be rank 1 [B], got shape {tuple(r.shape)}")
    return r


def _group_size(where: str, group_size: Any, low: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < low:
        raise ValueError(f"{where}: group_size must be an int >= {low}, got {group_size!r}")
    return group_size


def _check_groups(where: str, b: int, group_size: int) -> None:
    if b == 0 or b % group_size:
        raise ValueError(
            f"{where}: the number of rewards ({b}) must be a positive multiple of "
            f"group_size={group_size}"
        )


def _concrete_nonnegative(where: str, name: str, x: jax.Array) -> None:
    """Value check of a concrete (non-traced) array: finite and ``≥ 0``."""
    if isinstance(x, jax.core.Tracer):
        return
    a = np.asarray(x)
    bad = ~(np.isfinite(a) & (a >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: {name}[{i}] = {a[i]!r}; {name} must be finite and >= 0")


def group_advantages(
    rewards: Any,
    *,
    group_size: int,
    estimator: str = "grpo",
    eps: float | None = None,
    lengths: Any = None,
    norm_adv_by_std: bool = True,
) -> jax.Array:
    """Per-sequence advantages from outcome rewards of groups of samples of the same prompt.

    ``rewards`` holds ``B = G·n`` outcome rewards ``R_i`` (``n = group_size``), groups contiguous
    (``rewards[g·n:(g+1)·n]``). With group mean ``μ_g`` and unbiased (ddof=1) standard deviation
    ``σ_g``:

    * ``"grpo"``: ``A_i = (R_i − μ_g) / (σ_g + eps)`` (Shao et al. 2024; verl/SkyRL, eps 1e-6);
      ``norm_adv_by_std=False`` gives ``R_i − μ_g`` (verl ``norm_adv_by_std_in_grpo``).
    * ``"dr_grpo"``: ``A_i = R_i − μ_g`` (Liu et al. 2025, Dr. GRPO; Tinker cookbook default).
    * ``"rloo"``: ``A_i = R_i − mean_{j≠i} R_j = n/(n−1)·(R_i − μ_g)`` (Ahmadian et al. 2024).
    * ``"grpo_passk"``: only the group's argmax (the *first* maximum) gets ``r_max − r_2nd``
      (the two largest values; 0 on a tie), divided by ``σ_g + eps`` when ``norm_adv_by_std``;
      every other sample gets 0 (verl ``compute_grpo_passk_outcome_advantage``, eps 1e-6; needs
      ``n ≥ 2``).
    * ``"maxrl"``: ``A_i = (R_i − μ_g) / (μ_g + eps)`` (SkyRL ``compute_maxrl_advantage``, eps
      1e-6); a singleton group (``n = 1``) keeps ``A_i = R_i``.
    * ``"trl_batch"``: ``A_i = (R_i − μ_g) / (σ_batch + eps)`` where ``σ_batch`` is the
      Bessel-corrected std of the **raw** rewards over all B (TRL ``scale_rewards="batch"``,
      eps 1e-4).
    * ``"opo"``: ``A_i = R_i − Σ_j N_j R_j / Σ_j N_j`` over the group, with ``N_j = lengths[j]``
      the response lengths (verl ``compute_opo_outcome_advantage``); a singleton group has
      baseline 0, and so has a group whose lengths sum to 0 (verl: 0/0 = nan).

    A group whose rewards are all equal gets advantages exactly 0 under grpo, dr_grpo, rloo,
    grpo_passk, maxrl and trl_batch. REINFORCE++(-baseline) and ReMax are token-level: see
    `reinforce_pp_advantages`, `reinforce_pp_baseline_advantages`, `remax_advantages`.

    Args:
      rewards: outcome rewards, finite; float[B].
      group_size: samples per prompt ``n``; ``n ≥ 2`` (``n ≥ 1`` for maxrl and opo); divides B.
      estimator: one of `GROUP_ESTIMATORS` (`ESTIMATORS` plus ``"opo"``).
      eps: ``> 0``; ``None`` = the estimator's default (1e-6; 1e-4 for ``"trl_batch"``).
        Unused by dr_grpo, rloo, opo.
      lengths: response lengths ``N_j ≥ 0`` (``action_mask.sum(1)``), float[B]; ``"opo"`` only.
      norm_adv_by_std: divide by ``σ_g + eps`` (``"grpo"`` and ``"grpo_passk"`` only; default
        True).

    Returns:
      float[B] advantages.

    Example:
      >>> import losses
      >>> [round(float(a), 4) for a in losses.group_advantages([1., 0., 1., 1.], group_size=2)]
      [0.7071, -0.7071, 0.0, 0.0]
      >>> [round(float(a), 5) for a in losses.group_advantages(
      ...     [0.9, 0.5, 0.2], group_size=3, estimator="grpo_passk")]
      [1.13899, 0.0, 0.0]
    """
    where = "group_advantages"
    check_choice(where, "estimator", estimator, GROUP_ESTIMATORS)
    n = _group_size(where, group_size, 1 if estimator in _SINGLETON_OK else 2)
    if eps is None:
        eps = DEFAULT_EPS.get(estimator, 1e-6)
    eps = check_number(where, "eps", eps, low=0.0, low_open=True)
    if not isinstance(norm_adv_by_std, bool):
        raise ValueError(f"{where}: norm_adv_by_std must be a bool, got {norm_adv_by_std!r}")
    if not norm_adv_by_std and estimator not in ("grpo", "grpo_passk"):
        raise ValueError(
            f"{where}: norm_adv_by_std=False applies only to estimator 'grpo' or 'grpo_passk', "
            f"not {estimator!r}"
        )
    if (lengths is None) != (estimator != "opo"):
        raise ValueError(
            f"{where}: lengths must be given for estimator 'opo' and only for it "
            f"(estimator={estimator!r})"
        )
    r = _rewards_B(where, rewards)
    _check_groups(where, r.shape[0], n)
    g = r.reshape(-1, n)
    if estimator == "opo":
        lens = jnp.asarray(lengths)
        if tuple(lens.shape) != tuple(r.shape):
            raise ValueError(
                f"{where}: lengths has shape {tuple(lens.shape)}, expected {tuple(r.shape)} "
                "like rewards"
            )
        _concrete_nonnegative(where, "lengths", lens)
        lens = lens.astype(r.dtype).reshape(-1, n)
        if n == 1:
            return r
        total = jnp.sum(lens, axis=1, keepdims=True)
        has_len = total > 0
        baseline = jnp.where(
            has_len, jnp.sum(lens * g, axis=1, keepdims=True) / jnp.where(has_len, total, 1.0), 0.0
        )
        return (g - baseline).reshape(-1)
    if estimator == "maxrl" and n == 1:
        return r
    mean = jnp.mean(g, axis=1, keepdims=True)
    centered = g - mean
    if estimator == "dr_grpo" or (estimator == "grpo" and not norm_adv_by_std):
        adv = centered
    elif estimator == "rloo":
        adv = centered * (n / (n - 1))
    elif estimator == "maxrl":
        adv = centered / (mean + eps)
    elif estimator == "trl_batch":
        dev = r - jnp.mean(r)
        std = jnp.sqrt(jnp.sum(dev * dev) / (r.shape[0] - 1))
        adv = centered / (std + eps)
    else:
        std = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True) / (n - 1))
        if estimator == "grpo":
            adv = centered / (std + eps)
        else:  # grpo_passk
            first = jnp.argmax(g, axis=1)[:, None] == jnp.arange(n)[None, :]
            r_max = jnp.max(g, axis=1, keepdims=True)
            r_2nd = jnp.max(jnp.where(first, -jnp.inf, g), axis=1, keepdims=True)
            gap = r_max - r_2nd
            if norm_adv_by_std:
                gap = gap / (std + eps)
            adv = jnp.where(first, gap, jnp.zeros((), g.dtype))
    return adv.reshape(-1)


# -- token-level estimators ---------------------------------------------------------------------


def discounted_returns(
    rewards: Any, mask: Any, *, gamma: float = 1.0, reset_on_mask: bool = False
) -> jax.Array:
    """Per-token discounted return-to-go ``G_t = r_t + γ·G_{t+1}`` over the masked tokens.

    Run backwards over ``t`` (``jax.lax.scan``, ``reverse=True``) from ``G = 0`` after the last
    position. At a masked position (``m_t = 0``) the reward is ignored and

    * ``reset_on_mask=False`` (default; verl ``compute_reinforce_plus_plus_outcome_advantage``
      as docs/sources.md#critic-and-advantage-estimators reads it at 1dda039): ``G`` is carried through
      unchanged (no discount across the span), the same skip rule as `gae`;
    * ``reset_on_mask=True`` (SkyRL, and verl before that commit, "reset after EOS"): ``G`` is
      reset to 0, so earlier tokens see nothing after a masked token.

    With ``γ = 1`` and no reward on masked tokens the two agree with every reading of "carry".
    Outputs are exactly 0 on masked positions (which may hold inf/nan).

    Args:
      rewards: token-level rewards; float[B, T].
      mask: 1.0 on the tokens that count (``action_mask``), else 0.0; float[B, T].
      gamma: discount ``γ ∈ [0, 1]`` (verl default 1); a static Python float.
      reset_on_mask: reset ``G`` at masked positions instead of carrying it.

    Returns:
      float[B, T] returns ``G``, 0 on masked positions.

    Example:
      >>> import losses
      >>> [float(g) for g in losses.discounted_returns([[1., 0., 2.]], [[1., 1., 1.]],
      ...                                              gamma=0.5)[0]]
      [1.5, 1.0, 2.0]
    """
    where = "discounted_returns"
    gamma = check_number(where, "gamma", gamma, low=0.0, high=1.0)
    if not isinstance(reset_on_mask, bool):
        raise ValueError(f"{where}: reset_on_mask must be a bool, got {reset_on_mask!r}")
    r, m = token_arrays(where, rewards=rewards, mask=mask)
    valid = m > 0
    r = safe(r, valid)
    zero = jnp.zeros((), r.dtype)

    def step(g_next, xs):
        r_t, valid_t = xs
        g = r_t + gamma * g_next
        carried = zero if reset_on_mask else g_next
        return jnp.where(valid_t, g, carried), jnp.where(valid_t, g, zero)

    _, g_TB = jax.lax.scan(step, jnp.zeros(r.shape[:1], r.dtype), (r.T, valid.T), reverse=True)
    return g_TB.T


def reinforce_pp_advantages(
    rewards: Any,
    mask: Any,
    *,
    gamma: float = 1.0,
    reset_on_mask: bool = False,
    eps: float = 1e-8,
) -> jax.Array:
    """REINFORCE++ advantages: discounted returns, then masked whitening over the whole batch.

    ``A = masked_whiten(G, m)`` with ``G = discounted_returns(r, m, γ)`` (verl / SkyRL
    ``compute_reinforce_plus_plus_outcome_advantage``; Hu 2025, arXiv:2501.03262): mean and
    unbiased variance over every action token of the batch. ``reset_on_mask`` chooses SkyRL's
    reset over verl's carry (see `discounted_returns`).

    Args:
      rewards: token-level rewards; float[B, T].
      mask: ``action_mask``; float[B, T].
      gamma: discount ``γ ∈ [0, 1]`` (default 1).
      reset_on_mask: reset the return at masked positions (SkyRL) instead of carrying it.
      eps: added to the variance (verl 1e-8).

    Returns:
      float[B, T] advantages, 0 on masked positions.

    Example:
      >>> import losses
      >>> a = losses.reinforce_pp_advantages([[0., 0., 1.], [0., 0., 0.]], [[1.] * 3] * 2)
      >>> [round(float(x), 5) for x in a[:, 0]]
      [0.91287, -0.91287]
    """
    g = discounted_returns(rewards, mask, gamma=gamma, reset_on_mask=reset_on_mask)
    return masked_whiten(g, mask, eps=eps)


def reinforce_pp_baseline_advantages(
    rewards: Any, mask: Any, *, group_size: int, eps: float = 1e-8
) -> jax.Array:
    """REINFORCE++-baseline: ``R_i − μ_g`` tiled over tokens, then token-weighted whitening.

    ``A_it = masked_whiten((R_i − μ_g)·m_it, m)`` with ``μ_g`` the mean of the outcome rewards of
    row ``i``'s contiguous group; a singleton group (``group_size=1``) has ``μ_g = 0`` (verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``). The whitening statistics are
    over action tokens, so longer responses weigh more.

    Args:
      rewards: outcome rewards ``R_i = Σ_t r_it``; float[B].
      mask: ``action_mask``; float[B, T].
      group_size: samples per prompt, ``≥ 1``; divides B.
      eps: added to the variance (verl 1e-8).

    Returns:
      float[B, T] advantages, 0 on masked positions.

    Example:
      >>> import losses
      >>> a = losses.reinforce_pp_baseline_advantages([1., 0.], [[1., 1.], [1., 0.]], group_size=2)
      >>> [[round(float(x), 4) for x in row] for row in a]
      [[0.5774, 0.5774], [-1.1547, 0.0]]
    """
    where = "reinforce_pp_baseline_advantages"
    n = _group_size(where, group_size, 1)
    eps = check_number(where, "eps", eps, low=0.0, low_open=True)
    r = _rewards_B(where, rewards)
    (m,) = token_arrays(where, mask=mask)
    if m.shape[0] != r.shape[0]:
        raise ValueError(
            f"{where}: mask has {m.shape[0]} rows, expected B={r.shape[0]} like rewards"
        )
    _check_groups(where, r.shape[0], n)
    g = r.reshape(-1, n)
    centered = g if n == 1 else g - jnp.mean(g, axis=1, keepdims=True)
    tiled = jnp.broadcast_to(centered.reshape(-1)[:, None], m.shape)
    return masked_whiten(safe(tiled, m > 0), m, eps=eps)


def remax_advantages(rewards: Any, baseline: Any, mask: Any) -> jax.Array:
    """ReMax: the undiscounted return-to-go minus the greedy rollout's reward; no whitening.

    ``A_it = Σ_{s≥t} r_is·m_is − b_i`` on action tokens (verl ``compute_remax_outcome_advantage``;
    Li et al. 2023, arXiv:2310.10505), with ``b_i`` the reward of a greedy (argmax) response to
    row ``i``'s prompt, which the caller samples and scores.

    Args:
      rewards: token-level rewards; float[B, T].
      baseline: the greedy baseline rewards ``b``; float[B].
      mask: ``action_mask``; float[B, T].

    Returns:
      float[B, T] advantages, 0 on masked positions.

    Example:
      >>> import losses
      >>> a = losses.remax_advantages([[0., 0., 1.]], [0.4], [[1., 1., 1.]])
      >>> [round(float(x), 4) for x in a[0]]
      [0.6, 0.6, 0.6]
    """
    where = "remax_advantages"
    r, m = token_arrays(where, rewards=rewards, mask=mask)
    b = jnp.asarray(baseline)
    if tuple(b.shape) != tuple(r.shape[:1]):
        raise ValueError(
            f"{where}: baseline has shape {tuple(b.shape)}, expected [B]={tuple(r.shape[:1])}"
        )
    valid = m > 0
    g = discounted_returns(r, m, gamma=1.0)
    return safe(g - b.astype(g.dtype)[:, None], valid)
