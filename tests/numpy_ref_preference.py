"""Independent NumPy references (value, analytic gradient, metrics) for the preference terms.

Written from docs/sources.md#preference-terms with plain ``math`` on Python floats, pair by pair,
sharing no code with `losses`. Each per-pair loss comes with its analytic derivatives with respect
to the completions' logprob sums ``S_c`` and ``S_r``; the gradient with respect to a token's
logprob is ``m_t·∂L/∂S`` of its row. `finite_difference` checks those derivatives with a central
difference in ``S``. Defaults are restated here on purpose.

Conventions restated from the docstrings of `losses.dpo` and friends: rows are interleaved pairs
(row 2k chosen, 2k+1 rejected), a pair with an empty completion contributes 0, and the value is
the sum of per-pair losses over ``P = num_rows/2`` (``num_rows`` carried, or the count of rows
with an action or observation token), ``P ≥ 1``.
"""

from __future__ import annotations

import math

import numpy as np


def sig(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def logsig(z: float) -> float:
    if z >= 0:
        return -math.log1p(math.exp(-z))
    return z - math.log1p(math.exp(z))


def _f(batch, name):
    v = batch.get(name)
    return None if v is None else np.asarray(v, np.float64)


def _rows(lp, batch, with_ref=True):
    """Per-row (S, R, N) lists over the action mask."""
    lp = np.asarray(lp, np.float64)
    m = _f(batch, "action_mask")
    ref = _f(batch, "ref_logprobs") if with_ref else None
    b, t = m.shape
    S, R, N = [0.0] * b, [0.0] * b, [0.0] * b
    for i in range(b):
        for j in range(t):
            if m[i, j] > 0:
                S[i] += m[i, j] * lp[i, j]
                N[i] += m[i, j]
                if ref is not None:
                    R[i] += m[i, j] * ref[i, j]
    return lp, m, S, R, N


def num_rows(batch) -> float:
    carried = batch.get("num_rows")
    if carried is not None:
        return float(np.asarray(carried))
    m = _f(batch, "action_mask")
    obs = _f(batch, "obs_mask")
    if obs is None:
        obs = np.zeros_like(m)
    return float(sum(1 for i in range(m.shape[0]) if (m[i] > 0).any() or (obs[i] > 0).any()))


def pair_count(batch) -> float:
    return max(num_rows(batch) / 2.0, 1.0)


# -- per-pair losses with d/dS_c, d/dS_r --------------------------------------------------------


def _cdpo(z, eps):
    """value and d/dz of −(1−ε)logσ(z) − ε logσ(−z)."""
    return -(1 - eps) * logsig(z) - eps * logsig(-z), -(1 - eps) * sig(-z) + eps * sig(z)


def dpo_pair(loss_type, S_c, R_c, S_r, R_r, N_c, N_r, *, beta=0.1, eps=0.0, tau=0.05):
    """(ℓ, ∂ℓ/∂S_c, ∂ℓ/∂S_r) of one DPO pair (not for the sorted AOT types)."""
    c, rho = S_c - R_c, S_r - R_r
    x = beta * (c - rho)
    h = 1.0 / (2.0 * beta)
    if loss_type == "sigmoid":
        v, dx = _cdpo(x, eps)
        return v, beta * dx, -beta * dx
    if loss_type == "hinge":
        v = max(0.0, 1.0 - x)
        dx = -1.0 if 1.0 - x > 0 else 0.0
        return v, beta * dx, -beta * dx
    if loss_type == "ipo":
        bar = c / N_c - rho / N_r
        return (bar - h) ** 2, 2 * (bar - h) / N_c, -2 * (bar - h) / N_r
    if loss_type == "robust":
        v = (-(1 - eps) * logsig(x) + eps * logsig(-x)) / (1 - 2 * eps)
        dx = (-(1 - eps) * sig(-x) - eps * sig(x)) / (1 - 2 * eps)
        return v, beta * dx, -beta * dx
    if loss_type == "exo_pair":
        a, b_ = math.log(1 - eps), math.log(eps)
        v = sig(x) * (logsig(x) - a) + sig(-x) * (logsig(-x) - b_)
        dx = sig(x) * sig(-x) * (x - a + b_)
        return v, beta * dx, -beta * dx
    if loss_type == "bco_pair":
        v = -logsig(beta * c) - logsig(-beta * rho)
        return v, -beta * sig(-beta * c), beta * sig(beta * rho)
    if loss_type == "sppo_hard":
        return (c - h) ** 2 + (rho + h) ** 2, 2 * (c - h), 2 * (rho + h)
    if loss_type == "nca_pair":
        v = -logsig(beta * c) - 0.5 * logsig(-beta * c) - 0.5 * logsig(-beta * rho)
        dc = -beta * sig(-beta * c) + 0.5 * beta * sig(beta * c)
        return v, dc, 0.5 * beta * sig(beta * rho)
    if loss_type == "apo_zero":
        v = 1 - sig(beta * c) + sig(beta * rho)
        dc = -beta * sig(beta * c) * sig(-beta * c)
        return v, dc, beta * sig(beta * rho) * sig(-beta * rho)
    if loss_type == "apo_down":
        v = sig(beta * c) + 1 - sig(x)
        sx = sig(x) * sig(-x)
        return v, beta * sig(beta * c) * sig(-beta * c) - beta * sx, beta * sx
    if loss_type == "discopop":
        g = sig(x / tau)
        gp = g * (1 - g) / tau
        v = -logsig(x) * (1 - g) + math.exp(-x) * g
        dx = -sig(-x) * (1 - g) - math.exp(-x) * g + gp * (logsig(x) + math.exp(-x))
        return v, beta * dx, -beta * dx
    if loss_type == "sigmoid_norm":
        bar = c / N_c - rho / N_r
        d = -beta * sig(-beta * bar)
        return -logsig(beta * bar), d / N_c, -d / N_r
    if loss_type == "sft":
        return -S_c / N_c, -1.0 / N_c, 0.0
    raise ValueError(loss_type)


def _pairs_of(S, R, N):
    out = []
    for k in range(len(S) // 2):
        c, r = 2 * k, 2 * k + 1
        out.append((k, c, r, N[c] > 0 and N[r] > 0))
    return out


def _scatter(lp, m, dS):
    g = np.zeros_like(lp)
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if m[i, j] > 0:
                g[i, j] = m[i, j] * dS[i]
    return g


def _metrics(pairs, beta_c, beta_r, S):
    ok = [p for p in pairs if p[3]]
    n = max(len(ok), 1)
    return {
        "reward_accuracy": sum(1.0 for k, *_ in ok if beta_c[k] > beta_r[k]) / n,
        "reward_margin": sum(beta_c[k] - beta_r[k] for k, *_ in ok) / n,
        "chosen_reward": sum(beta_c[k] for k, *_ in ok) / n,
        "rejected_reward": sum(beta_r[k] for k, *_ in ok) / n,
        "logps_chosen": sum(S[c] for _, c, _, _ in ok) / n,
        "logps_rejected": sum(S[r] for _, _, r, _ in ok) / n,
        "num_pairs": float(len(ok)),
    }


def dpo_ref(lp, batch, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, discopop_tau=0.05):
    """(value, grad[B, T], metrics) of `losses.dpo`."""
    lp, m, S, R, N = _rows(lp, batch, with_ref=loss_type != "sft")
    pairs = _pairs_of(S, R, N)
    P = pair_count(batch)
    eps = label_smoothing
    dS = [0.0] * len(S)
    total = 0.0
    beta_c = {k: beta * (S[c] - R[c]) for k, c, r, _ in pairs}
    beta_r = {k: beta * (S[r] - R[r]) for k, c, r, _ in pairs}
    if loss_type in ("aot", "aot_unpaired"):
        ok = [p for p in pairs if p[3]]
        if loss_type == "aot":
            u = [(S[c] - S[r], c, r, +1) for _, c, r, _ in ok]
            v = [(R[c] - R[r], c, r, +1) for _, c, r, _ in ok]
        else:
            u = [(S[c] - R[c], c, None, +1) for _, c, r, _ in ok]
            v = [(S[r] - R[r], r, None, +1) for _, c, r, _ in ok]
        us = sorted(u, key=lambda e: e[0])
        vs = sorted(v, key=lambda e: e[0])
        for (uk, uc, ur, _), (vk, vc, _vr, _) in zip(us, vs, strict=True):
            value, dz = _cdpo(beta * (uk - vk), eps)
            total += value
            if loss_type == "aot":  # u = S_c − S_r; v holds reference sums only
                dS[uc] += beta * dz / P
                dS[ur] -= beta * dz / P
            else:  # u = c (chosen row uc), v = ρ (rejected row vc)
                dS[uc] += beta * dz / P
                dS[vc] -= beta * dz / P
    else:
        for _, c, r, ok in pairs:
            if not ok:
                continue
            value, d_c, d_r = dpo_pair(
                loss_type, S[c], R[c], S[r], R[r], N[c], N[r], beta=beta, eps=eps, tau=discopop_tau
            )
            total += value
            dS[c] += d_c / P
            dS[r] += d_r / P
    return total / P, _scatter(lp, m, dS), _metrics(pairs, beta_c, beta_r, S)


# -- CPO / SimPO / ORPO -------------------------------------------------------------------------


def cpo_pair(
    loss_type, S_c, S_r, N_c, N_r, *, beta=0.1, eps=0.0, gamma=0.5, cpo_alpha=1.0, alpha=0.0
):
    """(ℓ, ∂ℓ/∂S_c, ∂ℓ/∂S_r, π_c, π_r) of one CPO pair; π are the logps the loss uses."""
    averaged = loss_type in ("ipo", "simpo")
    pc, pr = (S_c / N_c, S_r / N_r) if averaged else (S_c, S_r)
    dpc_dS, dpr_dS = (1 / N_c, 1 / N_r) if averaged else (1.0, 1.0)
    if alpha != 0.0:
        fc, fr = (1 - math.exp(-alpha * pc)) / alpha, (1 - math.exp(-alpha * pr)) / alpha
        dpc_dS *= math.exp(-alpha * pc)
        dpr_dS *= math.exp(-alpha * pr)
        pc, pr = fc, fr
    z = pc - pr
    if loss_type == "sigmoid":
        v, dz = _cdpo(beta * z, eps)
        dz *= beta
    elif loss_type == "hinge":
        v = max(0.0, 1 - beta * z)
        dz = -beta if 1 - beta * z > 0 else 0.0
    elif loss_type == "ipo":
        v = (z - 1 / (2 * beta)) ** 2
        dz = 2 * (z - 1 / (2 * beta))
    elif loss_type == "simpo":
        v, dz = _cdpo(beta * z - gamma, eps)
        dz *= beta
    else:
        raise ValueError(loss_type)
    v += cpo_alpha * (-S_c / N_c)
    return v, dz * dpc_dS - cpo_alpha / N_c, -dz * dpr_dS, pc, pr


def cpo_ref(
    lp,
    batch,
    *,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
    cpo_alpha=1.0,
    simpo_gamma=0.5,
    alpha=0.0,
):
    """(value, grad, metrics) of `losses.cpo`."""
    lp, m, S, R, N = _rows(lp, batch, with_ref=False)
    pairs = _pairs_of(S, R, N)
    P = pair_count(batch)
    dS = [0.0] * len(S)
    total = 0.0
    bc, br, nll = {}, {}, []
    for k, c, r, ok in pairs:
        if not ok:
            continue
        v, d_c, d_r, pc, pr = cpo_pair(
            loss_type,
            S[c],
            S[r],
            N[c],
            N[r],
            beta=beta,
            eps=label_smoothing,
            gamma=simpo_gamma,
            cpo_alpha=cpo_alpha,
            alpha=alpha,
        )
        total += v
        dS[c] += d_c / P
        dS[r] += d_r / P
        bc[k], br[k] = beta * pc, beta * pr
        nll.append(-S[c] / N[c])
    metrics = _metrics(pairs, bc, br, S)
    metrics["nll"] = sum(nll) / max(len(nll), 1)
    return total / P, _scatter(lp, m, dS), metrics


def simpo_ref(lp, batch, *, beta=0.1, gamma=0.5, label_smoothing=0.0):
    return cpo_ref(
        lp,
        batch,
        beta=beta,
        loss_type="simpo",
        label_smoothing=label_smoothing,
        cpo_alpha=0.0,
        simpo_gamma=gamma,
    )


def log1mexp(x: float) -> float:
    """log(1 − eˣ), x < 0."""
    return math.log1p(-math.exp(x)) if x < -math.log(2) else math.log(-math.expm1(x))


def orpo_pair(S_c, S_r, N_c, N_r, *, beta=0.1, cap=-1e-6):
    """(ℓ, ∂ℓ/∂S_c, ∂ℓ/∂S_r, lor, ℓ̄_c, ℓ̄_r) with ℓ = NLL_c − β·logσ(lor)."""
    mc_raw, mr_raw = S_c / N_c, S_r / N_r
    mc, mr = min(mc_raw, cap), min(mr_raw, cap)
    lor = (mc - mr) - (log1mexp(mc) - log1mexp(mr))
    v = -S_c / N_c - beta * logsig(lor)
    dlor_c = 1.0 / (-math.expm1(mc)) if mc_raw < cap else 0.0
    dlor_r = -1.0 / (-math.expm1(mr)) if mr_raw < cap else 0.0
    dv_dlor = -beta * sig(-lor)
    return v, (dv_dlor * dlor_c - 1.0) / N_c, dv_dlor * dlor_r / N_r, lor, mc, mr


def orpo_ref(lp, batch, *, beta=0.1):
    lp, m, S, R, N = _rows(lp, batch, with_ref=False)
    pairs = _pairs_of(S, R, N)
    P = pair_count(batch)
    dS = [0.0] * len(S)
    total = 0.0
    bc, br, nll, lors, logodds = {}, {}, [], [], []
    for k, c, r, ok in pairs:
        if not ok:
            continue
        v, d_c, d_r, lor, mc, mr = orpo_pair(S[c], S[r], N[c], N[r], beta=beta)
        total += v
        dS[c] += d_c / P
        dS[r] += d_r / P
        bc[k], br[k] = beta * mc, beta * mr
        nll.append(-S[c] / N[c])
        lors.append(lor)
        logodds.append(logsig(lor))
    metrics = _metrics(pairs, bc, br, S)
    n = max(len(nll), 1)
    metrics.update(nll=sum(nll) / n, log_odds_chosen=sum(lors) / n, log_odds_ratio=sum(logodds) / n)
    return total / P, _scatter(lp, m, dS), metrics


# -- KTO ----------------------------------------------------------------------------------------


def kto_row(u, label, *, beta=0.1, z0=0.0, w_d=1.0, w_u=1.0):
    """(ℓ, ∂ℓ/∂S) of one KTO row with log-ratio u = S − R."""
    if label > 0:
        z = beta * (u - z0)
        return w_d * (1 - sig(z)), -w_d * beta * sig(z) * sig(-z)
    z = beta * (z0 - u)
    return w_u * (1 - sig(z)), w_u * beta * sig(z) * sig(-z)


def kto_ref(lp, batch, *, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto"):
    lp, m, S, R, N = _rows(lp, batch)
    labels = _f(batch, "labels")
    z0 = float(np.asarray(batch.kl_baseline)) if loss_type == "kto" else 0.0
    rows = max(num_rows(batch), 1.0)
    dS = [0.0] * len(S)
    total = 0.0
    good, bad = [], []
    for i in range(len(S)):
        if N[i] <= 0:
            continue
        u = S[i] - R[i]
        v, d = kto_row(u, labels[i], beta=beta, z0=z0, w_d=desirable_weight, w_u=undesirable_weight)
        total += v
        dS[i] = d / rows
        (good if labels[i] > 0 else bad).append(beta * u)
    chosen = sum(good) / max(len(good), 1)
    rejected = sum(bad) / max(len(bad), 1)
    metrics = {
        "chosen_reward": chosen,
        "rejected_reward": rejected,
        "reward_margin": chosen - rejected,
        "kl_baseline": z0,
        "num_desirable": float(len(good)),
        "num_undesirable": float(len(bad)),
    }
    return total / rows, _scatter(lp, m, dS), metrics


def kto_kl_baseline_ref(lp, batch) -> float:
    _, _, S, R, N = _rows(lp, batch)
    ratios = [S[i] - R[i] for i in range(len(S)) if N[i] > 0]
    return max(sum(ratios) / max(len(ratios), 1), 0.0)


# -- finite-difference check of the analytic derivatives ----------------------------------------


def finite_difference(f, S_c, S_r, h=1e-6):
    """Central differences ``(∂f/∂S_c, ∂f/∂S_r)`` of a scalar ``f(S_c, S_r)``."""
    d_c = (f(S_c + h, S_r) - f(S_c - h, S_r)) / (2 * h)
    d_r = (f(S_c, S_r + h) - f(S_c, S_r - h)) / (2 * h)
    return d_c, d_r
