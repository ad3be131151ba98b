"""Independent NumPy references (value and analytic gradient) for the core terms.

Written from the formulas in docs/sources.md and docs/echo.md with explicit loops over
rows, so that they share no code with `losses`.
"""

from __future__ import annotations

import numpy as np


def _np(batch, name):
    v = batch.get(name)
    return None if v is None else np.asarray(v, np.float64)


def active_row_count(action, obs):
    return sum(1 for i in range(action.shape[0]) if action[i].any() or obs[i].any())


def reduction_weights(mask, reduction, n_rows, max_tokens=None):
    b, t = mask.shape
    w = np.zeros((b, t))
    total = mask.sum()
    n = max(n_rows, 1)
    for i in range(b):
        row_len = mask[i].sum()
        for j in range(t):
            if mask[i, j] == 0:
                continue
            if reduction == "token_sum":
                w[i, j] = 1.0
            elif reduction == "token_mean":
                w[i, j] = 1.0 / max(total, 1.0)
            elif reduction == "seq_mean_token_sum":
                w[i, j] = 1.0 / n
            elif reduction == "seq_mean_token_mean":
                w[i, j] = 1.0 / (n * max(row_len, 1.0))
            elif reduction == "seq_mean_token_sum_norm":
                w[i, j] = 1.0 / (n * max_tokens)
            else:
                raise ValueError(reduction)
    return w


def _masks(batch):
    action = _np(batch, "action_mask")
    obs = _np(batch, "obs_mask")
    if obs is None:
        obs = np.zeros_like(action)
    return action, obs


def grpo_ref(
    lp,
    batch,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    kl_coef=0.0,
    kl_estimator="k3",
    reduction="token_mean",
    max_tokens=None,
    max_log_ratio=20.0,
):
    """Returns (value, grad[B, T])."""
    lp = np.asarray(lp, np.float64)
    action, obs = _masks(batch)
    old = _np(batch, "old_logprobs")
    ref = _np(batch, "ref_logprobs")
    adv = _np(batch, "advantages")
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], lp.shape[1], axis=1)
    w = reduction_weights(action, reduction, active_row_count(action, obs), max_tokens)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    value, grad = 0.0, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(action), strict=True):
        a, d = adv[i, j], lp[i, j] - old[i, j]
        inside = abs(d) < max_log_ratio
        r = np.exp(np.clip(d, -max_log_ratio, max_log_ratio))
        dr = r if inside else 0.0
        loss = max(-a * r, -a * min(max(r, lo), hi))
        zero_grad = (a > 0 and r > hi) or (a < 0 and r < lo)
        g = 0.0 if zero_grad else -a * dr
        if dual_clip is not None and a < 0 and loss > -dual_clip * a:
            loss, g = -dual_clip * a, 0.0
        if kl_coef > 0:
            dk = lp[i, j] - ref[i, j]
            kin = abs(dk) < max_log_ratio
            dk = np.clip(dk, -max_log_ratio, max_log_ratio)
            if kl_estimator == "k1":
                k, gk = dk, 1.0
            elif kl_estimator == "k2":
                k, gk = 0.5 * dk * dk, dk
            else:
                k, gk = np.exp(-dk) + dk - 1.0, 1.0 - np.exp(-dk)
            loss += kl_coef * k
            g += kl_coef * gk * (1.0 if kin else 0.0)
        value += w[i, j] * loss
        grad[i, j] = w[i, j] * g
    return value, grad


def echo_env_ref(lp, batch, *, coef=0.05, normalization="seq_mean_token_mean"):
    lp = np.asarray(lp, np.float64)
    action, obs = _masks(batch)
    n = max(active_row_count(action, obs), 1)
    total_obs = obs.sum()
    value, grad = 0.0, np.zeros_like(lp)
    for i in range(lp.shape[0]):
        cnt = obs[i].sum()
        for j in range(lp.shape[1]):
            if obs[i, j] == 0:
                continue
            if normalization == "token_sum":
                wij = coef
            elif normalization == "token_mean":
                wij = coef / max(total_obs, 1.0)
            else:
                wij = coef / (n * max(cnt, 1.0))
            value += wij * -lp[i, j]
            grad[i, j] = -wij
    return value, grad


def sft_ref(lp, batch, *, reduction="token_mean", max_tokens=None):
    lp = np.asarray(lp, np.float64)
    action, obs = _masks(batch)
    w = reduction_weights(action, reduction, active_row_count(action, obs), max_tokens)
    value = float(sum(w[i, j] * -lp[i, j] for i, j in zip(*np.nonzero(action), strict=True)))
    return value, -w


def weighted_ce_ref(lp, batch):
    lp = np.asarray(lp, np.float64)
    w = _np(batch, "weights")
    value = float(sum(w[i, j] * -lp[i, j] for i, j in zip(*np.nonzero(w), strict=True)))
    return value, -w
