"""Independent NumPy references (value and gradient, float64) for the distillation terms.

Written from docs/sources.md#distillation (and #entropy) with explicit loops over tokens and top-K
entries, sharing no code with `losses`. Sampled-token forms have analytic gradients; the top-K
divergences get a central finite difference of the per-token divergence in each student entry
(plus analytic gradients for the forms whose derivative is short, see `topk_grad_analytic`).
"""

from __future__ import annotations

import math

import numpy as np

from tests.numpy_ref import active_row_count, reduction_weights

TAIL_LOG_MASS_MAX = -1e-7
FD_STEP = 1e-6


def _np(batch, name):
    v = batch.get(name)
    return None if v is None else np.asarray(v, np.float64)


def _weights(batch, reduction, max_tokens):
    action = _np(batch, "action_mask")
    obs = _np(batch, "obs_mask")
    if obs is None:
        obs = np.zeros_like(action)
    return action, reduction_weights(action, reduction, active_row_count(action, obs), max_tokens)


# -- sampled-token reverse KL -------------------------------------------------------------------


def distillation_advantages_ref(s, t, mask, *, coef=1.0, discount=0.0):
    """A_t = Σ_{u ≥ t} γ^(u-t)·(-coef·(s_u - t_u)·m_u), zeroed off the mask; backward loop."""
    s, t, mask = (np.asarray(x, np.float64) for x in (s, t, mask))
    out = np.zeros_like(mask)
    for i in range(mask.shape[0]):
        running = 0.0
        for j in reversed(range(mask.shape[1])):
            x = -coef * (s[i, j] - t[i, j]) if mask[i, j] > 0 else 0.0
            running = x + discount * running
            out[i, j] = running if mask[i, j] > 0 else 0.0
    return out


def reverse_kl_ref(
    lp,
    batch,
    *,
    form="importance_sampling",
    coef=1.0,
    discount=0.0,
    kl_tau=None,
    prob_delta_low=None,
    reduction="token_mean",
    max_tokens=None,
    max_log_ratio=20.0,
):
    """Returns (value, grad[B, T]) of `reverse_kl_distillation`."""
    lp = np.asarray(lp, np.float64)
    action, w = _weights(batch, reduction, max_tokens)
    teacher = _np(batch, "teacher_logprobs")
    old = _np(batch, "old_logprobs")
    if form == "importance_sampling":
        adv = distillation_advantages_ref(old, teacher, action, discount=discount)
    tau = 1e-3 if kl_tau is None else kl_tau
    low = 0.2 if prob_delta_low is None else prob_delta_low
    value, grad = 0.0, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(action), strict=True):
        p, t = lp[i, j], teacher[i, j]
        if form in ("importance_sampling", "ref_kl"):
            d = p - old[i, j]
            inside = abs(d) < max_log_ratio
            d = min(max(d, -max_log_ratio), max_log_ratio)
            r = math.exp(d)
            if form == "importance_sampling":
                loss = -r * adv[i, j]
                g = -r * adv[i, j] if inside else 0.0
            else:
                keep = math.exp(p) - math.exp(old[i, j]) >= -low
                a = t - p
                loss = (-a * r if keep else 0.0) + tau * d * d
                g = ((-a * r if keep else 0.0) + 2.0 * tau * d) if inside else 0.0
        else:
            d = p - t
            inside = abs(d) < max_log_ratio
            d = min(max(d, -max_log_ratio), max_log_ratio)
            if form == "k2":
                loss, g = 0.5 * d * d, d
            elif form == "k3":
                loss, g = math.exp(-d) + d - 1.0, 1.0 - math.exp(-d)
            else:
                raise ValueError(form)
            g = g if inside else 0.0
        value += coef * w[i, j] * loss
        grad[i, j] = coef * w[i, j] * g
    return value, grad


# -- top-K divergences --------------------------------------------------------------------------


def _log_sum_exp(xs):
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _tail(xs):
    """xs + [log(1 - Σ e^x)], the mass clamped below 1 like TRL."""
    log_mass = min(_log_sum_exp(xs), TAIL_LOG_MASS_MAX)
    return list(xs) + [math.log(-math.expm1(log_mass))]


def _renorm(xs):
    z = _log_sum_exp(xs)
    return [x - z for x in xs]


def _kl(a, b):
    return sum(math.exp(x) * (x - y) for x, y in zip(a, b, strict=True))


def _support(s, t, renormalize, tail):
    if tail:
        return _tail(s), _tail(t)
    if renormalize == "both":
        return _renorm(s), _renorm(t)
    if renormalize == "teacher":
        return list(s), _renorm(t)
    return list(s), list(t)


def topk_divergence_ref(kind, s, t, *, beta=0.5, renormalize="none", tail=False):
    """Per-token divergence of one position from its K student and teacher logprobs."""
    ls, lt = _support(s, t, renormalize, tail)
    if kind == "topk_forward_kl":
        d = _kl(lt, ls)
        return max(d, 0.0) if (renormalize == "none" and not tail) else d
    if kind == "topk_reverse_kl":
        return _kl(ls, lt)
    assert kind == "topk_jsd", kind
    if beta == 0.0:
        return _kl(lt, ls)
    if beta == 1.0:
        return _kl(ls, lt)
    lm = [
        math.log((1 - beta) * math.exp(x) + beta * math.exp(y)) for x, y in zip(ls, lt, strict=True)
    ]
    return beta * _kl(lt, lm) + (1 - beta) * _kl(ls, lm)


def topk_grad_fd(kind, s, t, **opts):
    """Central finite difference of the per-token divergence in each student entry."""
    g = np.zeros(len(s))
    for k in range(len(s)):
        up, down = list(s), list(s)
        up[k] += FD_STEP
        down[k] -= FD_STEP
        g[k] = (
            topk_divergence_ref(kind, up, t, **opts) - topk_divergence_ref(kind, down, t, **opts)
        ) / (2 * FD_STEP)
    return g


def topk_grad_analytic(kind, s, t, *, renormalize="none", tail=False, beta=None):
    """The closed-form gradients of the forward and reverse KL forms (docstring formulas)."""
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    p, q = np.exp(s), np.exp(t)
    if kind == "topk_forward_kl":
        if tail:
            tp, tq = 1 - p.sum(), 1 - q.sum()
            return -q + tq * p / tp
        if renormalize == "both":
            return p / p.sum() - q / q.sum()
        if renormalize == "teacher":
            return -q / q.sum()
        return -q if (q * (t - s)).sum() > 0 else np.zeros_like(q)
    if kind == "topk_reverse_kl":
        if tail:
            tp, tq = 1 - p.sum(), 1 - q.sum()
            return p * (s - t - math.log(tp) + math.log(tq))
        ph, qh = p / p.sum(), q / q.sum()
        kl = float((ph * (np.log(ph) - np.log(qh))).sum())
        return ph * (np.log(ph) - np.log(qh) - kl)
    raise ValueError(kind)


def topk_ref(kind, lp_BTK, batch, *, coef=1.0, reduction="token_mean", max_tokens=None, **opts):
    """Returns (value, grad[B, T, K]) of a top-K term; the gradient by finite differences."""
    lp = np.asarray(lp_BTK, np.float64)
    teacher = _np(batch, "teacher_topk_logprobs")
    action, w = _weights(batch, reduction, max_tokens)
    value, grad = 0.0, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(action), strict=True):
        s, t = list(lp[i, j]), list(teacher[i, j])
        value += coef * w[i, j] * topk_divergence_ref(kind, s, t, **opts)
        grad[i, j] = coef * w[i, j] * topk_grad_fd(kind, s, t, **opts)
    return value, grad


def topk_entropy_ref(xs, approx):
    if approx == "tail":
        xs = _tail(xs)
    elif approx == "renormalized":
        xs = _renorm(xs)
    return -sum(math.exp(x) * x for x in xs)
