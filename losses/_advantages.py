"""Group-relative advantage estimators."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from losses._common import check_choice, check_number

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def group_advantages(
    rewards: Any, *, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> jax.Array:
    """Per-sequence advantages from rewards of groups of samples of the same prompt.

    ``rewards`` holds ``B = G·group_size`` rewards, groups contiguous (``rewards[g·n:(g+1)·n]``).
    With group mean ``μ_g`` and unbiased (ddof=1) standard deviation ``σ_g``:

    * ``"grpo"``: ``A_i = (R_i - μ_g) / (σ_g + eps)`` (Shao et al. 2024; verl/SkyRL, eps=1e-6).
    * ``"dr_grpo"``: ``A_i = R_i - μ_g`` (Liu et al. 2025, Dr. GRPO; Tinker cookbook default).
    * ``"rloo"``: ``A_i = R_i - mean_{j≠i} R_j = n/(n-1)·(R_i - μ_g)`` (Ahmadian et al. 2024).

    A group whose rewards are all equal gets advantages exactly 0 under every estimator.

    Args:
      rewards: float[B].
      group_size: samples per prompt, ``n ≥ 2``; must divide B.
      estimator: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
      eps: ``> 0``, added to σ for ``"grpo"``.

    Returns:
      float[B] advantages.

    Example:
      >>> import losses
      >>> [round(float(a), 4) for a in losses.group_advantages([1., 0., 1., 1.], group_size=2)]
      [0.7071, -0.7071, 0.0, 0.0]
    """
    where = "group_advantages"
    check_choice(where, "estimator", estimator, ESTIMATORS)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"{where}: group_size must be an int >= 2, got {group_size!r}")
    eps = check_number(where, "eps", eps, low=0.0, low_open=True)
    r = jnp.asarray(rewards)
    if not jnp.issubdtype(r.dtype, jnp.floating):
        r = r.astype(jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"{where}: rewards must be rank 1 [B], got shape {r.shape}")
    if r.shape[0] == 0 or r.shape[0] % group_size:
        raise ValueError(
            f"{where}: the number of rewards ({r.shape[0]}) must be a positive multiple of "
            f"group_size={group_size}"
        )
    g = r.reshape(-1, group_size)
    centered = g - jnp.mean(g, axis=1, keepdims=True)
    if estimator == "dr_grpo":
        adv = centered
    elif estimator == "rloo":
        adv = centered * (group_size / (group_size - 1))
    else:
        std = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True) / (group_size - 1))
        adv = centered / (std + eps)
    return adv.reshape(-1)
