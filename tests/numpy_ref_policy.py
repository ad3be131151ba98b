"""Independent NumPy references (value and analytic gradient) for the policy family.

Written from the formulas of reference/policy-losses.md §3, §7 and the Fireworks SDK reference
§4, token by token with explicit loops, sharing no code with `losses` (the reduction weights come
from tests/numpy_ref.py, itself independent). Every function returns ``(value, grad[B, T])`` of
``L = Σ w·c·ℓ (+ β·Σ w·k)`` for the given batch and constructor keywords; defaults are restated
here on purpose.
"""

from __future__ import annotations

import math

import numpy as np

from tests.numpy_ref import active_row_count, reduction_weights


def _f(batch, name):
    v = batch.get(name)
    return None if v is None else np.asarray(v, np.float64)


def _setup(lp, batch, reduction, max_tokens):
    lp = np.asarray(lp, np.float64)
    action = _f(batch, "action_mask")
    obs = _f(batch, "obs_mask")
    obs = np.zeros_like(action) if obs is None else obs
    adv = _f(batch, "advantages")
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], lp.shape[1], axis=1)
    w = reduction_weights(action, reduction, active_row_count(action, obs), max_tokens)
    return lp, action, adv, w


def _clamp(d, m):
    """Clamped value and its derivative (1 strictly inside, 0 outside)."""
    return min(max(d, -m), m), (1.0 if abs(d) < m else 0.0)


def _bounds(cfg, thresholds, offsets):
    if cfg.get("clip_low") is not None or cfg.get("clip_high") is not None:
        el = offsets[0] if cfg.get("clip_low") is None else cfg["clip_low"]
        eh = offsets[1] if cfg.get("clip_high") is None else cfg["clip_high"]
        return 1.0 - el, 1.0 + eh
    lo = thresholds[0] if cfg.get("clip_low_threshold") is None else cfg["clip_low_threshold"]
    hi = thresholds[1] if cfg.get("clip_high_threshold") is None else cfg["clip_high_threshold"]
    return lo, hi


# -- mismatch correction ----------------------------------------------------------------------


def correction_ref(batch, corr):
    """(c[B, T], metrics) of a MismatchCorrection (or its config dict); ones when None."""
    action = _f(batch, "action_mask")
    b, t = action.shape
    if corr is None:
        return action.copy(), {}
    cfg = corr if isinstance(corr, dict) else corr.as_config()
    m = cfg.get("max_log_ratio", 20.0)
    old = _f(batch, "old_logprobs")
    samp = _f(batch, "sampling_logprobs")
    c = np.zeros((b, t))
    flagged_tokens, flagged_rows, rows, ratios = 0, 0, 0, []
    n_tokens = int(action.sum())

    def weight(rho):
        if cfg["kind"] == "tis":
            return min(rho, cfg["cap"]), rho > cfg["cap"]
        ok = cfg["low"] <= rho <= cfg["high"]
        return (rho if ok else 0.0), not ok

    for i in range(b):
        logs = {}
        for j in range(t):
            if action[i, j] > 0:
                logs[j] = _clamp(old[i, j] - samp[i, j], m)[0]
                ratios.append(math.exp(logs[j]))
        if not logs:
            continue
        rows += 1
        if cfg["level"] == "token":
            for j, lr in logs.items():
                c[i, j], flag = weight(math.exp(lr))
                flagged_tokens += flag
        else:
            total = sum(logs.values())
            rho = math.exp(total) if total < 700 else math.inf
            ci, flag = weight(rho)
            flagged_rows += flag
            for j in logs:
                c[i, j] = ci
    frac_name = "mismatch_truncated_frac" if cfg["kind"] == "tis" else "mismatch_rejected_frac"
    if cfg["level"] == "token":
        frac = flagged_tokens / max(n_tokens, 1)
    else:
        frac = flagged_rows / max(rows, 1)
    metrics = {
        "mismatch_weight_mean": c.sum() / max(n_tokens, 1),
        "mismatch_ratio_mean": sum(ratios) / max(n_tokens, 1),
        frac_name: frac,
    }
    return c, metrics


# -- per-token terms --------------------------------------------------------------------------


def _kl(lp_ij, ref_ij, estimator, m):
    dk, inside = _clamp(lp_ij - ref_ij, m)
    if estimator == "k1":
        return dk, inside
    if estimator == "k2":
        return 0.5 * dk * dk, dk * inside
    return math.exp(-dk) + dk - 1.0, (1.0 - math.exp(-dk)) * inside


def _ppo_token(a, r, dr, lo, hi, dual):
    loss = max(-a * r, -a * min(max(r, lo), hi))
    zero = (a > 0 and r > hi) or (a < 0 and r < lo)
    g = 0.0 if zero else -a * dr
    if dual is not None and a < 0 and loss > -dual * a:
        loss, g = -dual * a, 0.0
    return loss, g


def _binary_div(lp_ij, old_ij, divergence):
    pi, mu = math.exp(min(lp_ij, 0.0)), math.exp(min(old_ij, 0.0))
    if divergence == "binary_tv":
        return abs(mu - pi)

    def xlog(x, y):  # x·log(x/y) with 0·log 0 = 0
        return 0.0 if x == 0 else x * (math.log(x) - math.log(y))

    return xlog(mu, pi) + xlog(1.0 - mu, 1.0 - pi)


def policy_ref(kind, lp, batch, **cfg):
    """(value, grad) of ``losses.<kind>(**cfg)`` on (lp, batch); ``kind`` may also be ``grpo``."""
    if kind in ("gspo", "gmpo"):
        return _sequence_ref(kind, lp, batch, **cfg)
    reduction = cfg.get("reduction", "seq_mean_token_mean" if kind == "sapo" else "token_mean")
    lp, action, adv, w = _setup(lp, batch, reduction, cfg.get("max_tokens"))
    m = cfg.get("max_log_ratio", 20.0)
    old = _f(batch, "old_logprobs")
    ref = _f(batch, "ref_logprobs")
    c, _ = correction_ref(batch, cfg.get("correction"))
    kl_coef = cfg.get("kl_coef", 0.0)
    estimator = cfg.get("kl_estimator", "k3")
    if kind == "ppo":
        lo, hi = _bounds(cfg, (0.8, 1.2), (0.2, 0.2))
    elif kind == "dapo":
        lo, hi = _bounds(cfg, (0.8, 1.28), (0.2, 0.28))
    elif kind == "cispo":
        lo, hi = _bounds(cfg, (0.0, 4.0), (0.2, 0.2))
    elif kind == "grpo":
        lo, hi = 1.0 - cfg.get("clip_low", 0.2), 1.0 + cfg.get("clip_high", 0.2)
    value, grad = 0.0, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(action), strict=True):
        a, p, q = adv[i, j], lp[i, j], old[i, j]
        d, din = _clamp(p - q, m)
        r = math.exp(d)
        if kind == "importance_sampling":
            loss, g = -a * r, -a * r * din
        elif kind == "ppo":
            loss, g = _ppo_token(a, r, r * din, lo, hi, None)
        elif kind == "dapo":
            loss, g = _ppo_token(a, r, r * din, lo, hi, cfg.get("eps_clip_c"))
        elif kind == "grpo":
            loss, g = _ppo_token(a, r, r * din, lo, hi, cfg.get("dual_clip"))
        elif kind == "cispo":
            coef = min(max(r, lo), hi)
            loss, g = -coef * a * p, -coef * a
        elif kind == "dro":
            beta = cfg.get("beta", 0.05)
            dev = p - q
            loss, g = -(p * a - 0.5 * beta * dev * dev), -(a - beta * dev)
        elif kind == "dppo":
            divergence = cfg.get("divergence", "binary_tv")
            delta = cfg.get("threshold")
            if delta is None:
                delta = {"binary_tv": 0.15, "binary_kl": 0.05}[divergence]
            improving = (a > 0 and p > q) or (a < 0 and p < q)
            keep = 0.0 if improving and _binary_div(p, q, divergence) > delta else 1.0
            loss, g = -r * a * keep, -r * a * keep * din
        elif kind == "reinforce":
            omega = 1.0
            if cfg.get("ratio_weight", False):
                omega = r if cfg.get("ratio_cap") is None else min(r, cfg["ratio_cap"])
            loss, g = -omega * a * p, -omega * a
        elif kind == "sapo":
            tau = cfg.get("tau_pos", 1.0) if a > 0 else cfg.get("tau_neg", 1.05)
            sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
            loss, g = -a * sig * 4.0 / tau, -a * 4.0 * sig * (1.0 - sig) * r * din
        else:
            raise ValueError(kind)
        loss, g = c[i, j] * loss, c[i, j] * g
        if kl_coef > 0:
            k, gk = _kl(p, ref[i, j], estimator, m)
            loss, g = loss + kl_coef * k, g + kl_coef * gk
        value += w[i, j] * loss
        grad[i, j] = w[i, j] * g
    return value, grad


def _sequence_ref(kind, lp, batch, **cfg):
    reduction = cfg.get("reduction", "seq_mean_token_mean")
    lp, action, adv, w = _setup(lp, batch, reduction, cfg.get("max_tokens"))
    m = cfg.get("max_log_ratio", 20.0)
    old = _f(batch, "old_logprobs")
    c, _ = correction_ref(batch, cfg.get("correction"))
    value, grad = 0.0, np.zeros_like(lp)
    if kind == "gspo":
        lo, hi = _bounds(cfg, (1.0 - 3e-4, 1.0 + 4e-4), (3e-4, 4e-4))
        cap = cfg.get("seq_ratio_log_cap", 10.0)
    else:
        el, eh = cfg.get("clip_low", 0.4), cfg.get("clip_high", 0.4)
    for i in range(lp.shape[0]):
        cols = [j for j in range(lp.shape[1]) if action[i, j] > 0]
        if not cols:
            continue
        n = len(cols)
        clamped = {j: _clamp(lp[i, j] - old[i, j], m) for j in cols}
        if kind == "gspo":
            mean = sum(clamped[j][0] for j in cols) / n
            s = math.exp(min(mean, cap))
            for j in cols:
                a = adv[i, j]
                loss = max(-a * s, -a * min(max(s, lo), hi))
                zero = (a > 0 and s > hi) or (a < 0 and s < lo) or mean > cap
                g = 0.0 if zero else -a * s  # ∂s_it/∂p_t = s_i: the gradient skips the clamp
                value += w[i, j] * c[i, j] * loss
                grad[i, j] = w[i, j] * c[i, j] * g
        else:
            xt, dxt = {}, {}
            for j in cols:
                a, (x, din) = adv[i, j], clamped[j]
                if a > 0:
                    xt[j], dxt[j] = min(x, eh), (din if x < eh else 0.0)
                elif a < 0:
                    xt[j], dxt[j] = max(x, -el), (din if x > -el else 0.0)
                else:
                    xt[j], dxt[j] = 0.0, 0.0
            rho = math.exp(sum(xt.values()) / n)
            abar = sum(adv[i, j] for j in cols) / n
            weight = sum(w[i, j] * c[i, j] for j in cols)
            value += weight * (-abar * rho)
            for j in cols:
                grad[i, j] = weight * (-abar * rho / n) * dxt[j]
    return value, grad
