"""Independent NumPy references (value and analytic gradient) for the policy family.

Written from the formulas of docs/sources.md#the-policy-family (and #mismatch-corrections) and the Fireworks SDK reference
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


def _rule_configs(corr):
    """The rule dicts of a correction: an object (``as_config()``), a dict, or a list (chain)."""
    cfg = corr if isinstance(corr, dict | list | tuple) else corr.as_config()
    if isinstance(cfg, dict):
        return [cfg], False
    rules = [r if isinstance(r, dict) else r.as_config() for r in cfg]
    return rules, len(rules) > 1


def rejection_statistic_ref(lr, statistic):
    """verl's per-token rejection statistic of ``lr = clamp(old - roll)`` (policy-losses-2 §1.3)."""
    if statistic == "k1":
        return -lr
    if statistic == "k2":
        return 0.5 * lr * lr
    return math.exp(lr) - 1.0 - lr


def _rule_ref(cfg, batch, lp, action):
    """(c[B, T], flagged fraction, log-ratio per valid token {(i, j): lr}, divisor or None)."""
    b, t = action.shape
    kind, level = cfg["kind"], cfg["level"]
    m = cfg.get("max_log_ratio", 20.0)
    c = np.zeros((b, t))
    rows = [i for i in range(b) if action[i].any()]
    cols = {i: [j for j in range(t) if action[i, j] > 0] for i in rows}
    n_tokens = sum(len(v) for v in cols.values())
    if kind == "opsm":
        beh = _f(batch, f"{cfg.get('behaviour', 'sampling')}_logprobs")
        adv = _f(batch, "advantages")
        if adv.ndim == 1:
            adv = np.repeat(adv[:, None], t, axis=1)
        lrs, dropped = {}, 0
        for i in rows:
            mean = sum(beh[i, j] - lp[i, j] for j in cols[i]) / len(cols[i])
            for j in cols[i]:
                lrs[(i, j)] = _clamp(lp[i, j] - beh[i, j], m)[0]
                drop = adv[i, j] < 0 and mean > cfg["delta"]
                c[i, j] = 0.0 if drop else 1.0
                dropped += drop
        return c, dropped / max(n_tokens, 1), lrs, None
    old, samp = _f(batch, "old_logprobs"), _f(batch, "sampling_logprobs")
    lrs = {(i, j): _clamp(old[i, j] - samp[i, j], m)[0] for i in rows for j in cols[i]}
    if kind == "rejection":
        stat = cfg["statistic"]
        if stat == "k1":
            lo = -math.inf if cfg["low"] == 0 else math.log(cfg["low"])
            hi = math.log(cfg["high"])
        else:
            lo, hi = -math.inf, cfg["high"]
        flagged = 0
        for i in rows:
            s = [rejection_statistic_ref(lrs[(i, j)], stat) for j in cols[i]]
            if level == "token":
                for j, sj in zip(cols[i], s, strict=True):
                    keep = lo <= sj <= hi
                    c[i, j] = 1.0 if keep else 0.0
                    flagged += not keep
                continue
            if level == "seq_max":
                keep = lo <= min(s) and max(s) <= hi
            else:
                agg = sum(s) if level == "seq_sum" else sum(s) / len(s)
                keep = lo <= agg <= hi
            flagged += not keep
            for j in cols[i]:
                c[i, j] = 1.0 if keep else 0.0
        denominator = n_tokens if level == "token" else len(rows)
        return c, flagged / max(denominator, 1), lrs, None

    def weight(rho):
        if kind == "tis":
            return min(rho, cfg["cap"]), rho > cfg["cap"]
        ok = cfg["low"] <= rho <= cfg["high"]
        return (rho if ok else 0.0), not ok

    flagged = 0
    row_weights = []
    for i in rows:
        if level == "token":
            for j in cols[i]:
                c[i, j], flag = weight(math.exp(lrs[(i, j)]))
                flagged += flag
        else:
            total = sum(lrs[(i, j)] for j in cols[i])
            rho = math.exp(total) if total < 700 else math.inf
            ci, flag = weight(rho)
            flagged += flag
            row_weights.append(ci)
            for j in cols[i]:
                c[i, j] = ci
    frac = flagged / max(n_tokens if level == "token" else len(rows), 1)
    divisor = None
    if cfg.get("batch_normalize", False):
        given = batch.get("is_weight_mean")
        if given is not None:
            mean = float(np.asarray(given))
        elif level == "token":
            mean = c.sum() / max(n_tokens, 1)
        else:
            mean = sum(row_weights) / max(len(rows), 1)
        divisor = mean if mean > 1e-8 else 1.0
        c = c / divisor
    return c, frac, lrs, divisor


def correction_ref(batch, corr, lp=None):
    """(c[B, T], metrics) of a correction (a MismatchCorrection, a chain, or their configs);
    ``action_mask`` and no metrics when None. ``lp`` (current logprobs) is needed by OPSM."""
    action = _f(batch, "action_mask")
    if corr is None:
        return action.copy(), {}
    rules, indexed = _rule_configs(corr)
    lp = None if lp is None else np.asarray(lp, np.float64)
    c = np.where(action > 0, 1.0, 0.0)
    metrics = {}
    diag = None
    for k, cfg in enumerate(rules):
        if cfg["kind"] == "opsm" and lp is None:
            raise ValueError("correction_ref: OPSM needs lp")
        ck, frac, lrs, divisor = _rule_ref(cfg, batch, lp, action)
        c = c * ck
        flag = "truncated" if cfg["kind"] == "tis" else "rejected"
        metrics[f"mismatch_{k}_{flag}_frac" if indexed else f"mismatch_{flag}_frac"] = frac
        if divisor is not None:
            metrics["mismatch_is_weight_mean"] = divisor
        if diag is None or (diag[0] == "opsm" and cfg["kind"] != "opsm"):
            diag = (cfg["kind"], lrs)
    ratios = [math.exp(v) for v in diag[1].values()]
    n_tokens = int(action.sum())
    s2 = sum(r * r for r in ratios)
    metrics.update(
        {
            "mismatch_weight_mean": c.sum() / max(n_tokens, 1),
            "mismatch_ratio_mean": sum(ratios) / max(n_tokens, 1),
            "mismatch_ratio_min": min(ratios, default=0.0),
            "mismatch_ratio_max": max(ratios, default=0.0),
            "mismatch_ratio_ess": sum(ratios) ** 2 / s2 if s2 > 0 else 0.0,
        }
    )
    return c, metrics


# -- per-token terms --------------------------------------------------------------------------


def _kl(lp_ij, ref_ij, estimator, m, score=False, old_ij=None):
    """(value, ∂/∂p) of one token's KL estimate (docs/sources.md#kl-variants); ``old_ij`` given:
    times ``r = exp(clamp(p - old))`` (product rule; ``r`` detached for score-function forms)."""
    dk, inside = _clamp(lp_ij - ref_ij, m)
    rho = math.exp(dk)
    if estimator == "k1":
        v, g = dk, 1.0
    elif estimator == "k2":
        v, g = 0.5 * dk * dk, dk
    elif estimator == "k3":
        v, g = math.exp(-dk) + dk - 1.0, 1.0 - math.exp(-dk)
    elif estimator == "sq_log_ratio":
        v, g = dk * dk, 2.0 * dk
    elif estimator in ("rllm_bwd", "rllm_bwd_sf"):
        v, g = rho - 1.0 - dk, rho - 1.0
    elif estimator == "rllm_fwd":
        v, g = rho * dk - rho + 1.0, rho * dk
    else:
        raise ValueError(estimator)
    score = score or estimator == "rllm_bwd_sf"
    if score:
        g = -1.0 if estimator == "rllm_bwd_sf" else dk
    g *= inside
    if old_ij is None:
        return v, g
    lr, lin = _clamp(lp_ij - old_ij, m)
    r = math.exp(lr)
    if score:
        return r * v, r * g
    return r * v, r * g + v * r * lin


def _kl_cfg(p, ref_ij, old_ij, cfg, m):
    """A policy term's KL keywords applied to one token."""
    return _kl(
        p,
        ref_ij,
        cfg.get("kl_estimator", "k3"),
        m,
        score=cfg.get("kl_score_function", False),
        old_ij=old_ij if cfg.get("kl_importance_weight", False) else None,
    )


def _ppo_token(a, r, dr, lo, hi, dual, delta=None):
    loss = max(-a * (r if delta is None else min(r, delta)), -a * min(max(r, lo), hi))
    if delta is None:
        zero = (a > 0 and r > hi) or (a < 0 and r < lo)
    else:  # -min(min(r, δ)·A, clip(r)·A): flat for A > 0 beyond min(hi, δ), A < 0 beyond max
        zero = (a > 0 and r > min(hi, delta)) or (a < 0 and (r < lo or r > max(hi, delta)))
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
    if kind in ("gspo", "gmpo", "luspo"):
        return _sequence_ref(kind, lp, batch, **cfg)
    if kind in NEW_KINDS:
        return new_policy_ref(kind, lp, batch, **cfg)
    reduction = cfg.get("reduction", "seq_mean_token_mean" if kind == "sapo" else "token_mean")
    lp, action, adv, w = _setup(lp, batch, reduction, cfg.get("max_tokens"))
    m = cfg.get("max_log_ratio", 20.0)
    old = _f(batch, "old_logprobs")
    ref = _f(batch, "ref_logprobs")
    c, _ = correction_ref(batch, cfg.get("correction"), lp)
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
            loss, g = _ppo_token(a, r, r * din, lo, hi, cfg.get("dual_clip"), cfg.get("delta"))
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
            k, gk = _kl_cfg(p, ref[i, j], q, dict(cfg, kl_estimator=estimator), m)
            loss, g = loss + kl_coef * k, g + kl_coef * gk
        value += w[i, j] * loss
        grad[i, j] = w[i, j] * g
    return value, grad


def _sequence_ref(kind, lp, batch, **cfg):
    reduction = cfg.get(
        "reduction", "seq_mean_token_sum" if kind == "luspo" else "seq_mean_token_mean"
    )
    lp, action, adv, w = _setup(lp, batch, reduction, cfg.get("max_tokens"))
    m = cfg.get("max_log_ratio", 20.0)
    old = _f(batch, "old_logprobs")
    c, _ = correction_ref(batch, cfg.get("correction"), lp)
    value, grad = 0.0, np.zeros_like(lp)
    if kind in ("gspo", "luspo"):
        lo, hi = _bounds(cfg, (1.0 - 3e-4, 1.0 + 4e-4), (3e-4, 4e-4))
        cap = math.inf if kind == "luspo" else cfg.get("seq_ratio_log_cap", 10.0)
        delta = cfg.get("delta")
    else:
        el, eh = cfg.get("clip_low", 0.4), cfg.get("clip_high", 0.4)
    for i in range(lp.shape[0]):
        cols = [j for j in range(lp.shape[1]) if action[i, j] > 0]
        if not cols:
            continue
        n = len(cols)
        clamped = {j: _clamp(lp[i, j] - old[i, j], m) for j in cols}
        if kind in ("gspo", "luspo"):
            mean = sum(clamped[j][0] for j in cols) / n
            s = math.exp(min(mean, cap))
            for j in cols:
                a = adv[i, j]
                loss, g = _ppo_token(a, s, s, lo, hi, None, delta)
                if mean > cap:
                    g = 0.0  # ∂s_it/∂p_t = s_i: the gradient skips the token clamp, not the cap
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


# -- newer objectives (docs/sources.md#newer-objectives) and the standalone KL term (§2) ---------------------

NEW_KINDS = ("clip_cov", "kl_cov", "vespo", "dppo_tv_kl")


def covariance_ref(lp, batch):
    """``{(i, j): (A - mean A)·(lp - mean lp)}`` over the valid tokens of the call (verl)."""
    lp = np.asarray(lp, np.float64)
    action = _f(batch, "action_mask")
    adv = _f(batch, "advantages")
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], lp.shape[1], axis=1)
    cells = [(i, j) for i in range(lp.shape[0]) for j in range(lp.shape[1]) if action[i, j] > 0]
    if not cells:
        return {}
    mean_a = sum(adv[c] for c in cells) / len(cells)
    mean_lp = sum(lp[c] for c in cells) / len(cells)
    return {c: (adv[c] - mean_a) * (lp[c] - mean_lp) for c in cells}


def clip_cov_candidates(lp, batch, **cfg):
    """(candidate cells, k): Clip-Cov may zero any ``min(k, |C|)`` cells of ``C``."""
    lp = np.asarray(lp, np.float64)
    old = _f(batch, "old_logprobs")
    adv = _f(batch, "advantages")
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], lp.shape[1], axis=1)
    lo, hi = _bounds(cfg, (0.8, 1.2), (0.2, 0.2))
    m = cfg.get("max_log_ratio", 20.0)
    lb, ub = cfg.get("clip_cov_lb", 1.0), cfg.get("clip_cov_ub", 5.0)
    cov = covariance_ref(lp, batch)
    cand = set()
    for c, v in cov.items():
        r = math.exp(_clamp(lp[c] - old[c], m)[0])
        clipped = (adv[c] > 0 and r > hi) or (adv[c] < 0 and r < lo)
        if not clipped and lb < v < ub:
            cand.add(c)
    k = max(int(cfg.get("clip_cov_ratio", 2e-4) * len(cov)), 1) if cov else 0
    return cand, k


def kl_cov_selected(lp, batch, ratio):
    """The KL-Cov cells: the k largest covariances, ties to the lower row-major index."""
    cov = covariance_ref(lp, batch)
    if not cov:
        return set()
    k = max(int(ratio * len(cov)), 1)
    t = np.asarray(lp).shape[1]
    order = sorted(cov, key=lambda c: (-cov[c], c[0] * t + c[1]))
    return set(order[:k])


def new_policy_ref(kind, lp, batch, zeroed=None, **cfg):
    """(value, grad) of clip_cov / kl_cov / vespo / dppo_tv_kl. For clip_cov, ``zeroed`` (a set
    of cells) is the random subset; None is only allowed when every candidate is zeroed."""
    reduction = cfg.get("reduction", "token_mean")
    lp, action, adv, w = _setup(lp, batch, reduction, cfg.get("max_tokens"))
    m = cfg.get("max_log_ratio", 20.0)
    anchor = _f(batch, "sampling_logprobs" if kind == "dppo_tv_kl" else "old_logprobs")
    corr = cfg.get("correction")
    c, _ = correction_ref(batch, corr, lp)
    if kind == "clip_cov":
        lo, hi = _bounds(cfg, (0.8, 1.2), (0.2, 0.2))
        cand, k = clip_cov_candidates(lp, batch, **cfg)
        if zeroed is None:
            if k < len(cand):
                raise ValueError("clip_cov_ref: the random subset is needed (k < |C|)")
            zeroed = cand
        assert zeroed <= cand and len(zeroed) == min(k, len(cand)), (zeroed, cand, k)
    elif kind == "kl_cov":
        chosen = kl_cov_selected(lp, batch, cfg.get("kl_cov_ratio", 2e-4))
        kappa = cfg.get("ppo_kl_coef", 0.1)
    elif kind == "vespo":
        lo_w, hi_w = math.log(1e-8), 20.0
        log_w = {}
        for i in range(lp.shape[0]):
            total = 0.0
            for j in range(lp.shape[1]):
                if action[i, j] > 0:
                    cij = min(max(c[i, j], 1e-8), math.exp(20.0))
                    total += _clamp(lp[i, j] - anchor[i, j], m)[0] + math.log(cij)
            log_w[i] = min(max(total, lo_w), hi_w)
    value, grad = 0.0, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(action), strict=True):
        a, p, q = adv[i, j], lp[i, j], anchor[i, j]
        d, din = _clamp(p - q, m)
        r = math.exp(d)
        if kind == "clip_cov":
            loss, g = _ppo_token(a, r, r * din, lo, hi, None)
            if (i, j) in zeroed:
                loss, g = 0.0, 0.0
        elif kind == "kl_cov":
            loss, g = -a * r, -a * r * din
            if (i, j) in chosen:
                sign = 0.0 if d == 0 else math.copysign(1.0, d)
                loss, g = loss + kappa * abs(d), g + kappa * sign * din
        elif kind == "vespo":
            if a >= 0:
                kk, lam = cfg.get("k_pos", 2.0), max(cfg.get("lambda_pos", 3.0), 1e-4)
            else:
                kk, lam = cfg.get("k_neg", 3.0), max(cfg.get("lambda_neg", 2.0), 1e-4)
            lw = log_w[i]
            phi = math.exp(lam + kk * lw - lam * math.exp(lw))
            loss, g = -phi * a * p, -phi * a
        else:  # dppo_tv_kl
            dp = math.exp(p) - math.exp(q)
            drop = (a > 0 and dp > cfg.get("mask_high", 0.2)) or (
                a <= 0 and dp < -cfg.get("mask_low", 0.2)
            )
            tau = cfg.get("adv_tau", 1.0)
            kl_tau = cfg.get("kl_tau", 1e-3)
            keep = 0.0 if drop else 1.0
            loss = -keep * tau * a * r + kl_tau * d * d
            g = (-keep * tau * a * r + 2.0 * kl_tau * d) * din
        if kind != "vespo":
            loss, g = c[i, j] * loss, c[i, j] * g
        value += w[i, j] * loss
        grad[i, j] = w[i, j] * g
    return value, grad


def kl_loss_ref(lp, batch, **cfg):
    """(value, grad) of ``losses.kl_loss(**cfg)``."""
    lp = np.asarray(lp, np.float64)
    action, _, _, w = _setup_no_adv(lp, batch, cfg.get("reduction", "token_mean"), cfg)
    m = cfg.get("max_log_ratio", 20.0)
    target = _f(batch, cfg.get("target", "ref_logprobs"))
    old = _f(batch, "old_logprobs")
    coef = cfg.get("coef", 1.0)
    value, grad = 0.0, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(action), strict=True):
        k, gk = _kl(
            lp[i, j],
            target[i, j],
            cfg.get("estimator", "k3"),
            m,
            score=cfg.get("score_function", False),
            old_ij=old[i, j] if cfg.get("importance_weight", False) else None,
        )
        value += coef * w[i, j] * k
        grad[i, j] = coef * w[i, j] * gk
    return value, grad


def _setup_no_adv(lp, batch, reduction, cfg):
    action = _f(batch, "action_mask")
    obs = _f(batch, "obs_mask")
    obs = np.zeros_like(action) if obs is None else obs
    w = reduction_weights(action, reduction, active_row_count(action, obs), cfg.get("max_tokens"))
    return action, obs, None, w
