"""Preference losses over sequence logprobs: the DPO family, SimPO, CPO, ORPO and KTO.

Notation (docs/sources.md#preference-terms): for a row ``i`` with action mask ``m``,
``S_i = Σ_t m·logp`` (the completion's logprob), ``R_i = Σ_t m·ref_logprobs`` (the same under the
reference), ``N_i = Σ_t m`` (its length) and ``ℓ_i = S_i / N_i`` (its mean token logprob).

**Pair layout** (DPO, SimPO, CPO, ORPO). Rows are interleaved pairs, the Tinker cookbook's layout
(``tinker_cookbook/preference/train_dpo.py``): row ``2k`` is the chosen and row ``2k + 1`` the
rejected completion of pair ``k``. With ``c = S_c − R_c``, ``ρ = S_r − R_r`` (the implicit rewards
divided by β), ``Δ = c − ρ`` and ``x = β·Δ``, a term's value is the **mean over pairs** of a
per-pair loss. The pair count is data: ``P = num_rows / 2``, from the carried ``Batch.num_rows``
(`losses.split_batch` sets it) or counted on the batch, so that a micro-batch holding whole pairs
gives exactly its share of the full mean and the micro-batch gradients concatenate to the full
one. A micro-batch must not cut a pair: `split_batch` cuts contiguous chunks of rows, so choose
``k`` such that every chunk has an even size (e.g. ``B = 2P`` and ``k`` dividing ``P``); an odd
row count raises ``ValueError`` when the term is traced, and `losses.check_batch` (with
``term=``) also rejects it. TRL instead stacks halves (``[chosen…, rejected…]``).

**Bad pairs.** ``check_batch(batch, term=term)`` raises ``ValueError`` for an odd row count, an
odd carried ``num_rows`` and a completion with no action token (naming the pair and the row). The
traced term stays NaN-safe on such data: a pair with an empty completion contributes 0 and gets
an exactly-zero gradient (so all-zero padding pairs change nothing in-graph), and positions with
``action_mask == 0`` may hold inf/nan.

**KTO** rows are not pairs: ``Batch.labels`` (``[B]``, 1 = desirable) says which rows are
desirable, and the batch KL baseline ``z0`` is the 0-d ``Batch.kl_baseline`` (computed once over
the optimizer batch with `kto_kl_baseline`, never inside a micro-batch).

Sources (commits in docs/sources.md#revisions-read): huggingface/trl
``trl/trainer/dpo_trainer.py::_compute_loss``, ``trl/experimental/cpo/cpo_trainer.py::cpo_loss``,
``trl/experimental/orpo/orpo_trainer.py::odds_ratio_loss``, ``trl/trainer/kto_trainer.py``;
OpenRLHF ``openrlhf/models/loss.py`` (``DPOLoss``); fw-ai/cookbook ``training/utils/losses.py``
(``make_batch_dpo_loss_fn``, ``make_batch_orpo_loss_fn``); tinker-cookbook
``preference/train_dpo.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from losses._batch import Batch, Term, check_logprobs_shape, count, require
from losses._common import check_choice, check_number, safe
from losses._reductions import num_rows as _num_rows

#: The TRL ``CPOConfig.loss_type`` values `cpo` implements.
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
#: The TRL ``KTOConfig.loss_type`` values `kto` implements.
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")

#: Loss types that read ``label_smoothing`` ε, with the allowed range ``(low, high, open ends)``;
#: every other loss type requires ε = 0 (TRL silently ignores it there).
_DPO_SMOOTHING = {
    "sigmoid": (0.0, 0.5, ""),
    "robust": (0.0, 0.5, "high"),  # divides by 1 − 2ε
    "exo_pair": (0.0, 1.0, "both"),  # log ε and log(1 − ε)
    "aot": (0.0, 0.5, ""),
    "aot_unpaired": (0.0, 0.5, ""),
}
_CPO_SMOOTHING = {"sigmoid": (0.0, 0.5, ""), "simpo": (0.0, 0.5, "")}
_CPO_AVERAGED = ("ipo", "simpo")
DEFAULT_DISCOPOP_TAU = 0.05
DEFAULT_SIMPO_GAMMA = 0.5
#: ORPO's mean token logprobs are clamped at this upper bound, so that ``log(1 − e^ℓ)`` stays
#: finite when ``ℓ`` rounds to 0 or a hair above it (fw-ai clamps to [−50, −1e-6]).
ORPO_MAX_MEAN_LOGPROB = -1e-6


# -- validation -----------------------------------------------------------------------------------


def _check_smoothing(where: str, loss_type: str, eps: Any, table: dict) -> float:
    eps = check_number(where, "label_smoothing", eps)
    if loss_type not in table:
        if eps != 0.0:
            users = ", ".join(repr(t) for t in table)
            raise ValueError(
                f"{where}: label_smoothing={eps!r} has no effect with loss_type={loss_type!r}; "
                f"only {users} read it (TRL ignores it silently; set it to 0)"
            )
        return eps
    low, high, open_ends = table[loss_type]
    low_bad = eps <= low if open_ends == "both" else eps < low
    high_bad = eps >= high if open_ends in ("both", "high") else eps > high
    if low_bad or high_bad:
        lo = "(" if open_ends == "both" else "["
        hi = ")" if open_ends in ("both", "high") else "]"
        hint = " (the EXO paper uses 1e-3)" if loss_type == "exo_pair" else ""
        raise ValueError(
            f"{where}: label_smoothing must be in {lo}{low}, {high}{hi} for "
            f"loss_type={loss_type!r}{hint}, got {eps!r}"
        )
    return eps


def _check_unused(where: str, name: str, value: float, default: float, used_by: str, loss_type):
    if value != default:
        raise ValueError(
            f"{where}: {name}={value!r} has no effect with loss_type={loss_type!r}; only "
            f"{used_by!r} reads it (leave it at its default {default!r})"
        )


def _check_even_rows(b: int, where: str) -> None:
    if b % 2:
        raise ValueError(
            f"{where}: the batch has {b} rows, an odd count; preference rows are interleaved "
            "pairs (row 2k chosen, row 2k+1 rejected), and a micro-batch must hold whole pairs "
            "(split_batch with every chunk of even size)"
        )


def _pair_validator(where: str):
    """``Term.validate`` of the pair terms: even rows, even ``num_rows``, no empty completion."""

    def validate(batch: Batch, logprobs: Any = None) -> None:
        b = batch.shape[0]
        if b % 2:
            raise ValueError(
                f"{where}: {b} rows, an odd row count: preference rows must come in pairs "
                "(row 2k chosen, row 2k+1 rejected); a micro-batch must not cut a pair"
            )
        lengths = (np.asarray(batch.action_mask) > 0).sum(axis=1)
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            row = int(empty[0])
            side = "chosen" if row % 2 == 0 else "rejected"
            raise ValueError(
                f"{where}: pair {row // 2} has an empty {side} completion (row {row} has no "
                "action token): every completion of a pair needs at least one action token"
            )

        if batch.num_rows is not None:
            n = float(np.asarray(batch.num_rows))
            if n % 2:
                raise ValueError(
                    f"{where}: num_rows = {n:g} is odd: it counts the rows of whole pairs "
                    "(2 per pair)"
                )

    return validate


def _kto_validator(where: str, needs_baseline: bool):
    def validate(batch: Batch, logprobs: Any = None) -> None:
        if batch.labels is None:
            raise ValueError(
                f"{where}: needs batch field 'labels' (1 = desirable, 0 = undesirable)"
            )
        if needs_baseline and batch.kl_baseline is None:
            raise ValueError(
                f"{where}: needs batch field 'kl_baseline' (z0); compute it over the whole "
                "optimizer batch with losses.kto_kl_baseline and set it before split_batch"
            )
        lengths = (np.asarray(batch.action_mask) > 0).sum(axis=1)
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            row = int(empty[0])
            raise ValueError(
                f"{where}: row {row} has an empty completion (no action token): every KTO row "
                "needs at least one action token"
            )

    return validate


# -- shared pieces --------------------------------------------------------------------------------


def _row_stats(lp: jax.Array, batch: Batch, with_ref: bool, where: str):
    """``(S[B], R[B] or None, N[B])``: masked sums of ``lp`` and ``ref_logprobs``, lengths."""
    m = batch.action_mask
    valid = m > 0
    mask = safe(m, valid).astype(lp.dtype)
    s = jnp.sum(mask * safe(lp, valid), axis=1)
    n = jnp.sum(mask, axis=1)
    r = None
    if with_ref:
        ref = require(batch, "ref_logprobs", where)
        r = jnp.sum(mask * safe(jnp.asarray(ref, lp.dtype), valid), axis=1)
    return s, r, n


def _split(x_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Interleaved rows ``[c0, r0, c1, r1, …]`` → ``(chosen[P], rejected[P])``."""
    x = x_B.reshape(-1, 2)
    return x[:, 0], x[:, 1]


def _pair_count(batch: Batch, dtype) -> jax.Array:
    """``P = num_rows / 2`` of the optimizer batch (carried or counted), at least 1."""
    return jnp.maximum(0.5 * jnp.asarray(_num_rows(batch), dtype), 1.0)


def _mean_over(x: jax.Array, ok: jax.Array) -> jax.Array:
    """Stop-gradient mean of ``x`` over the entries where ``ok`` (0 when none)."""
    x = jax.lax.stop_gradient(x)
    return jnp.sum(jnp.where(ok, x, 0.0)) / jnp.maximum(count(ok.astype(x.dtype)), 1.0)


def _cdpo(z: jax.Array, eps: float) -> jax.Array:
    """``−(1−ε)·logσ(z) − ε·logσ(−z)`` (cDPO; ε = 0 is the plain sigmoid loss)."""
    out = -jax.nn.log_sigmoid(z)
    if eps:
        out = (1.0 - eps) * out - eps * jax.nn.log_sigmoid(-z)
    return out


def _sorted_difference(u: jax.Array, v: jax.Array, ok: jax.Array):
    """``sort(u) − sort(v)`` over the valid pairs (AOT); invalid pairs sort last and are masked."""
    big = jnp.asarray(jnp.inf, u.dtype)
    us = jnp.sort(jnp.where(ok, u, big))
    vs = jnp.sort(jnp.where(ok, v, big))
    pos_ok = jnp.arange(u.shape[0]) < jnp.sum(ok)
    return safe(us, pos_ok) - safe(vs, pos_ok), pos_ok


class _Pair(NamedTuple):
    """What a DPO per-pair loss reads (`dpo`'s notation): the pair sums ``st`` (``s_c``,
    ``s_r``, ``r_c``, ``r_r``, ``n_c``, ``n_r``, ``ok``), ``c = S_c − R_c``, ``rho = S_r − R_r``,
    ``x = β·(c − ρ)`` and the hyperparameters β, ε (``label_smoothing``) and τ
    (``discopop_tau``)."""

    st: dict
    c: jax.Array
    rho: jax.Array
    x: jax.Array
    beta: float
    eps: float
    tau: float

    @property
    def half(self) -> float:
        return 1.0 / (2.0 * self.beta)

    @property
    def bar(self) -> jax.Array:
        """The length-averaged margin ``Δ̄ = c/N_c − ρ/N_r`` (TRL averages per token for
        ``ipo`` and ``sigmoid_norm``)."""
        return self.c / self.st["n_c"] - self.rho / self.st["n_r"]


def _robust(p: _Pair) -> jax.Array:
    x, eps = p.x, p.eps
    return (-(1.0 - eps) * jax.nn.log_sigmoid(x) + eps * jax.nn.log_sigmoid(-x)) / (1.0 - 2.0 * eps)


def _exo_pair(p: _Pair) -> jax.Array:
    x, eps = p.x, p.eps
    return jax.nn.sigmoid(x) * (jax.nn.log_sigmoid(x) - math.log1p(-eps)) + jax.nn.sigmoid(-x) * (
        jax.nn.log_sigmoid(-x) - math.log(eps)
    )


def _nca_pair(p: _Pair) -> jax.Array:
    bc, br = p.beta * p.c, p.beta * p.rho
    return -jax.nn.log_sigmoid(bc) - 0.5 * jax.nn.log_sigmoid(-bc) - 0.5 * jax.nn.log_sigmoid(-br)


def _aot(u: jax.Array, v: jax.Array, p: _Pair):
    d, on_sorted = _sorted_difference(u, v, p.st["ok"])
    return _cdpo(p.beta * d, p.eps), on_sorted


def _discopop(p: _Pair) -> jax.Array:
    # e^{−x}·σ(x/τ) = exp(−x + logσ(x/τ)): no inf·0 when x is very negative.
    x, tau = p.x, p.tau
    return -jax.nn.log_sigmoid(x) * jax.nn.sigmoid(-x / tau) + jnp.exp(
        -x + jax.nn.log_sigmoid(x / tau)
    )


#: `dpo`'s per-pair losses by TRL ``DPOConfig.loss_type``: ``f(pair) -> loss[P]``, or
#: ``(loss[P], on_sorted)`` for the types that sort over the call's pairs (``aot``).
_DPO_PAIR_LOSSES: dict[str, Callable[[_Pair], Any]] = {
    "sigmoid": lambda p: _cdpo(p.x, p.eps),
    "hinge": lambda p: jax.nn.relu(1.0 - p.x),
    "ipo": lambda p: jnp.square(p.bar - p.half),
    "robust": _robust,
    "exo_pair": _exo_pair,
    "bco_pair": lambda p: -jax.nn.log_sigmoid(p.beta * p.c) - jax.nn.log_sigmoid(-p.beta * p.rho),
    "sppo_hard": lambda p: jnp.square(p.c - p.half) + jnp.square(p.rho + p.half),
    "nca_pair": _nca_pair,
    "aot": lambda p: _aot(p.st["s_c"] - p.st["s_r"], p.st["r_c"] - p.st["r_r"], p),
    "aot_unpaired": lambda p: _aot(p.c, p.rho, p),
    "apo_zero": lambda p: 1.0 - jax.nn.sigmoid(p.beta * p.c) + jax.nn.sigmoid(p.beta * p.rho),
    "apo_down": lambda p: jax.nn.sigmoid(p.beta * p.c) + 1.0 - jax.nn.sigmoid(p.x),
    "discopop": _discopop,
    "sigmoid_norm": lambda p: -jax.nn.log_sigmoid(p.beta * p.bar),
    "sft": lambda p: -p.st["s_c"] / p.st["n_c"],
}
#: The TRL ``DPOConfig.loss_type`` values `dpo` implements (docs/sources.md#preference-terms).
DPO_LOSS_TYPES = tuple(_DPO_PAIR_LOSSES)


def _pair_metrics(dtype, ok, reward_c, reward_r, s_c, s_r) -> dict[str, jax.Array]:
    return {
        "reward_accuracy": _mean_over((reward_c > reward_r).astype(dtype), ok),
        "reward_margin": _mean_over(reward_c - reward_r, ok),
        "chosen_reward": _mean_over(reward_c, ok),
        "rejected_reward": _mean_over(reward_r, ok),
        "logps_chosen": _mean_over(s_c, ok),
        "logps_rejected": _mean_over(s_r, ok),
        "num_pairs": count(ok.astype(dtype)),
    }


def _pair_term(*, name: str, kind: str, config: dict, with_ref: bool, per_pair) -> Term:
    """A pair `Term` from ``per_pair(stats) -> (ℓ[P], on_sorted, reward_c[P], reward_r[P], extra)``.

    ``stats`` holds the sanitized per-pair ``s_c, s_r, r_c, r_r, n_c, n_r`` (0 for invalid
    pairs, lengths at least 1) and ``ok`` (both completions non-empty). ``ℓ`` is per pair, or
    per sorted position when ``on_sorted`` is a bool[P] mask of the valid positions (AOT).
    ``extra`` maps metric names to ``[P]`` arrays (averaged over valid pairs).
    """
    where = kind

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        _check_even_rows(lp.shape[0], where)
        batch = jax.lax.stop_gradient(batch)
        s, r, n = _row_stats(lp, batch, with_ref, where)
        s_c, s_r = _split(s)
        n_c, n_r = _split(n)
        ok = (n_c > 0) & (n_r > 0)
        zero = jnp.zeros_like(s_c)
        stats = {
            "ok": ok,
            "s_c": safe(s_c, ok),
            "s_r": safe(s_r, ok),
            "n_c": jnp.where(ok, n_c, 1.0),
            "n_r": jnp.where(ok, n_r, 1.0),
            "r_c": zero,
            "r_r": zero,
        }
        if with_ref:
            r_c, r_r = _split(r)
            stats["r_c"], stats["r_r"] = safe(r_c, ok), safe(r_r, ok)
        loss_P, on_sorted, reward_c, reward_r, extra = per_pair(stats)
        live = ok if on_sorted is None else on_sorted
        loss = jnp.sum(safe(loss_P, live)) / _pair_count(batch, lp.dtype)
        metrics = _pair_metrics(lp.dtype, ok, reward_c, reward_r, stats["s_c"], stats["s_r"])
        for key, value in extra.items():
            metrics[key] = _mean_over(value, ok)
        metrics["loss"] = jax.lax.stop_gradient(loss)
        return loss, metrics

    reads = {"action_mask", "obs_mask", "num_rows"}
    requires = {"action_mask"}
    if with_ref:
        reads.add("ref_logprobs")
        requires.add("ref_logprobs")
    return Term(
        name=name,
        fn=loss_fn,
        kind=kind,
        config=config,
        reads=frozenset(reads),
        requires=frozenset(requires),
        twin=None,
        validate=_pair_validator(kind),
    )


# -- DPO ------------------------------------------------------------------------------------------


def dpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    discopop_tau: float = DEFAULT_DISCOPOP_TAU,
) -> Term:
    """Direct preference optimization and its TRL loss types, over interleaved pairs.

    With ``c = S_c − R_c``, ``ρ = S_r − R_r``, ``Δ = c − ρ``, ``x = β·Δ``, ε = ``label_smoothing``
    and ``Δ̄ = c/N_c − ρ/N_r`` (per-token averages), the value is the mean over pairs (``P =
    num_rows/2``, see the module docstring) of:

    ================  ==========================================================================
    ``loss_type``     per-pair loss
    ================  ==========================================================================
    ``sigmoid``       ``−(1−ε)·logσ(x) − ε·logσ(−x)`` (cDPO; ε = 0: DPO)
    ``hinge``         ``relu(1 − x)``
    ``ipo``           ``(Δ̄ − 1/(2β))²``, **per-token averaged** as TRL does
    ``robust``        ``[−(1−ε)·logσ(x) + ε·logσ(−x)] / (1 − 2ε)``, ε ∈ [0, 0.5)
    ``exo_pair``      ``σ(x)·[logσ(x) − log(1−ε)] + σ(−x)·[logσ(−x) − log ε]``, ε ∈ (0, 1)
    ``bco_pair``      ``−logσ(β·c) − logσ(−β·ρ)`` (no running-mean shift)
    ``sppo_hard``     ``(c − 1/(2β))² + (ρ + 1/(2β))²``
    ``nca_pair``      ``−logσ(β·c) − ½·logσ(−β·c) − ½·logσ(−β·ρ)``
    ``aot``           cDPO of ``β·d_k``, ``d = sort_k(S_c − S_r) − sort_k(R_c − R_r)``
    ``aot_unpaired``  cDPO of ``β·d_k``, ``d = sort_k(c) − sort_k(ρ)``
    ``apo_zero``      ``1 − σ(β·c) + σ(β·ρ)``
    ``apo_down``      ``σ(β·c) + 1 − σ(x)``
    ``discopop``      ``−logσ(x)·(1 − g) + e^{−x}·g``, ``g = σ(x/τ)``, τ = ``discopop_tau``
    ``sigmoid_norm``  ``−logσ(β·Δ̄)``
    ``sft``           ``−S_c/N_c`` (the chosen completion's mean token NLL)
    ================  ==========================================================================

    The gradient of ``sigmoid`` is ``∂L/∂S_c = −β·[(1−ε)·σ(−x) − ε·σ(x)]/P = −∂L/∂S_r``,
    spread over the completion's action tokens (``∂S/∂logp_t = m_t``).

    Departures and notes:

    * ``sigmoid`` is the cDPO form (OpenRLHF ``DPOLoss``; this package's choice, issue #16).
      TRL's ``sigmoid`` has had **no label smoothing since the DPO refactor #3906**: with ε = 0
      the two agree. ``label_smoothing`` is read only by ``sigmoid``, ``robust``, ``exo_pair``,
      ``aot`` and ``aot_unpaired``; any other loss type with ε ≠ 0 raises ``ValueError`` (TRL
      ignores it silently). ``exo_pair`` needs ε > 0 (TRL replaces ε = 0 by 1e-3 silently;
      here it raises).
    * ``ipo`` averages per token (TRL, confirmed with the IPO authors); OpenRLHF
      ``DPOLoss(ipo=True)`` uses the sums (``(Δ − 1/(2β))²``), which is not offered here.
    * ``aot``/``aot_unpaired`` sort over the pairs the call sees (TRL: per device batch), so
      `losses.split_batch` is exact for them only with one micro-batch; one pair reduces to
      ``sigmoid``.
    * ``sft`` is the mean over pairs of each chosen completion's mean token NLL (exact under
      micro-batching); TRL takes one token mean over all chosen tokens of the batch — the two
      agree when the chosen completions have equal lengths.
    * Not implemented: TRL's ``f_divergence_type``, ``ld_alpha``, ``use_weighting`` (WPO needs
      full logits), lists of loss types with ``loss_weights`` (fold several terms instead).

    Sources: huggingface/trl ``trl/trainer/dpo_trainer.py::_compute_loss`` (defaults β 0.1,
    ``label_smoothing`` 0, ``discopop_tau`` 0.05); OpenRLHF ``openrlhf/models/loss.py``
    (``DPOLoss``, cDPO); tinker-cookbook ``preference/train_dpo.py`` (interleaved layout, mean
    over pairs, metrics); docs/sources.md#preference-terms.

    Args:
      beta: β > 0.
      loss_type: one of ``DPO_LOSS_TYPES``.
      label_smoothing: ε (see above for which loss types read it and its range).
      discopop_tau: τ > 0 of ``discopop`` (only that loss type reads it).

    Returns:
      A `Term` reading ``action_mask``, ``ref_logprobs`` (not for ``sft``) and ``num_rows``;
      ``validate`` checks the pair layout. Metrics (means over this call's valid pairs):
      ``loss``, ``reward_accuracy`` (share with ``c > ρ``, strict), ``reward_margin``
      (``β·(c − ρ)``), ``chosen_reward`` (``β·c``), ``rejected_reward`` (``β·ρ``; rewards use the
      sequence sums for every loss type), ``logps_chosen``/``logps_rejected`` (``S_c``, ``S_r``),
      ``num_pairs``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 1)), ref_logprobs=jnp.array([[-12.], [-14.]]))
      >>> loss, metrics = losses.dpo(beta=0.1)(jnp.array([[-10.], [-15.]]), b)
      >>> round(float(loss), 5), round(float(metrics["reward_margin"]), 5)
      (0.55436, 0.3)
    """
    where = "dpo"
    beta = check_number(where, "beta", beta, low=0.0, low_open=True)
    check_choice(where, "loss_type", loss_type, DPO_LOSS_TYPES)
    eps = _check_smoothing(where, loss_type, label_smoothing, _DPO_SMOOTHING)
    tau = check_number(where, "discopop_tau", discopop_tau, low=0.0, low_open=True)
    if loss_type != "discopop":
        _check_unused(where, "discopop_tau", tau, DEFAULT_DISCOPOP_TAU, "discopop", loss_type)
    pair_loss = _DPO_PAIR_LOSSES[loss_type]

    def per_pair(st):
        c = st["s_c"] - st["r_c"]
        rho = st["s_r"] - st["r_r"]
        out = pair_loss(_Pair(st, c, rho, beta * (c - rho), beta, eps, tau))
        loss, on_sorted = out if isinstance(out, tuple) else (out, None)
        return loss, on_sorted, beta * c, beta * rho, {}

    return _pair_term(
        name="dpo",
        kind="dpo",
        config=dict(beta=beta, loss_type=loss_type, label_smoothing=eps, discopop_tau=tau),
        with_ref=loss_type != "sft",
        per_pair=per_pair,
    )


# -- CPO / SimPO ----------------------------------------------------------------------------------


def _reference_free(
    *,
    where: str,
    kind: str,
    name: str,
    config: dict,
    beta: float,
    loss_type: str,
    eps: float,
    gamma: float,
    cpo_alpha: float,
    alpha: float,
) -> Term:
    """The CPO family (TRL ``cpo_loss``): a pair loss on policy logps only, + ``cpo_alpha``·NLL."""
    averaged = loss_type in _CPO_AVERAGED
    half = 1.0 / (2.0 * beta)

    def per_pair(st):
        if averaged:
            pc, pr = st["s_c"] / st["n_c"], st["s_r"] / st["n_r"]
        else:
            pc, pr = st["s_c"], st["s_r"]
        if alpha != 0.0:  # AlphaPO rewards (1 − p^{−α})/α = −expm1(−α·logp)/α
            pc, pr = -jnp.expm1(-alpha * pc) / alpha, -jnp.expm1(-alpha * pr) / alpha
        z = pc - pr
        if loss_type == "sigmoid":
            loss = _cdpo(beta * z, eps)
        elif loss_type == "hinge":
            loss = jax.nn.relu(1.0 - beta * z)
        elif loss_type == "ipo":
            loss = jnp.square(z - half)
        elif loss_type == "simpo":
            loss = _cdpo(beta * z - gamma, eps)
        else:  # pragma: no cover - validated by the constructors
            raise ValueError(loss_type)
        nll = -st["s_c"] / st["n_c"]
        if cpo_alpha != 0.0:
            loss = loss + cpo_alpha * nll
        return loss, None, beta * pc, beta * pr, {"nll": nll}

    return _pair_term(name=name, kind=kind, config=config, with_ref=False, per_pair=per_pair)


def cpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = DEFAULT_SIMPO_GAMMA,
    alpha: float = 0.0,
) -> Term:
    """Contrastive preference optimization (TRL ``CPOTrainer``): reference-free, plus a chosen NLL.

    With policy logps ``π_c, π_r`` — sums ``S`` for ``sigmoid``/``hinge``, per-token means
    ``S/N`` for ``ipo``/``simpo`` (as TRL) — optionally mapped to AlphaPO rewards
    ``(1 − e^{−α·π})/α`` when ``alpha ≠ 0``, and ``z = π_c − π_r``, the per-pair loss is::

        sigmoid  −(1−ε)·logσ(β·z) − ε·logσ(−β·z)
        hinge    relu(1 − β·z)
        ipo      (z − 1/(2β))²
        simpo    −(1−ε)·logσ(β·z − γ) − ε·logσ(−(β·z − γ))      (TRL: β·(z − γ/β))

    plus ``cpo_alpha · NLL_c``, and the value is the mean over pairs (``P = num_rows/2``, module
    docstring). ``NLL_c = −S_c/N_c`` is the chosen completion's mean token NLL over its action
    tokens. Departure: TRL's NLL is one token mean over all chosen tokens of the batch (exact
    micro-batching would need a carried chosen-token count); the two agree when the chosen
    completions have equal lengths.

    ``label_smoothing`` is read only by ``sigmoid`` and ``simpo`` (else it must be 0), and
    ``simpo_gamma`` only by ``simpo``. ``cpo(loss_type="simpo", cpo_alpha=0)`` is `simpo`.

    Source: huggingface/trl ``trl/experimental/cpo/cpo_trainer.py::cpo_loss`` (defaults β 0.1,
    ``cpo_alpha`` 1.0, ``simpo_gamma`` 0.5, ``alpha`` 0); docs/sources.md#preference-terms.

    Args:
      beta: β > 0.
      loss_type: one of ``CPO_LOSS_TYPES``.
      label_smoothing: ε ∈ [0, 0.5] (``sigmoid``, ``simpo``).
      cpo_alpha: weight ≥ 0 of the chosen NLL (TRL default 1.0).
      simpo_gamma: γ ≥ 0, the SimPO target margin (``simpo`` only).
      alpha: AlphaPO exponent; 0 = plain logps.

    Returns:
      A pair `Term` (reads ``action_mask``, ``num_rows``; no reference). Metrics: ``loss``,
      ``reward_accuracy``, ``reward_margin``, ``chosen_reward``/``rejected_reward`` (``β·π``),
      ``logps_chosen``/``logps_rejected`` (sums), ``nll``, ``num_pairs``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 2)))
      >>> lp = jnp.array([[-2.0, -3.0], [-3.0, -3.0]])  # means -2.5 and -3.0
      >>> t = losses.cpo(beta=2.0, loss_type="simpo", simpo_gamma=1.0, cpo_alpha=0.0)
      >>> round(float(t(lp, b)[0]), 5)
      0.69315
    """
    where = "cpo"
    beta = check_number(where, "beta", beta, low=0.0, low_open=True)
    check_choice(where, "loss_type", loss_type, CPO_LOSS_TYPES)
    eps = _check_smoothing(where, loss_type, label_smoothing, _CPO_SMOOTHING)
    cpo_alpha = check_number(where, "cpo_alpha", cpo_alpha, low=0.0)
    gamma = check_number(where, "simpo_gamma", simpo_gamma, low=0.0)
    if loss_type != "simpo":
        _check_unused(where, "simpo_gamma", gamma, DEFAULT_SIMPO_GAMMA, "simpo", loss_type)
    alpha = check_number(where, "alpha", alpha)
    return _reference_free(
        where=where,
        kind="cpo",
        name="cpo",
        config=dict(
            beta=beta,
            loss_type=loss_type,
            label_smoothing=eps,
            cpo_alpha=cpo_alpha,
            simpo_gamma=gamma,
            alpha=alpha,
        ),
        beta=beta,
        loss_type=loss_type,
        eps=eps,
        gamma=gamma,
        cpo_alpha=cpo_alpha,
        alpha=alpha,
    )


def simpo(
    *, beta: float = 0.1, gamma: float = DEFAULT_SIMPO_GAMMA, label_smoothing: float = 0.0
) -> Term:
    """SimPO: reference-free, length-normalized preference loss with a target margin γ.

    With ``ℓ_c = S_c/N_c`` and ``ℓ_r = S_r/N_r`` (mean token logprobs) the per-pair loss is::

        −(1−ε)·logσ(β·(ℓ_c − ℓ_r) − γ) − ε·logσ(−(β·(ℓ_c − ℓ_r) − γ))

    (TRL writes ``β·(Δ − γ/β)``), and the value is the mean over pairs (``P = num_rows/2``,
    module docstring). This is pure SimPO: TRL's ``CPOTrainer(loss_type="simpo")`` adds
    ``cpo_alpha·NLL`` with ``cpo_alpha`` defaulting to 1.0, so pure SimPO there needs
    ``cpo_alpha=0`` (as its docs say); ``losses.cpo(loss_type="simpo")`` is that CPO variant.
    The defaults are TRL's (β 0.1, ``simpo_gamma`` 0.5); the reference's worked example uses
    β 2, γ 1.

    Source: huggingface/trl ``trl/experimental/cpo/cpo_trainer.py::cpo_loss``;
    docs/sources.md#preference-terms.

    Args:
      beta: β > 0.
      gamma: γ ≥ 0, the target reward margin (TRL ``simpo_gamma``).
      label_smoothing: ε ∈ [0, 0.5].

    Returns:
      A pair `Term` (reads ``action_mask``, ``num_rows``). Metrics: ``loss``,
      ``reward_accuracy``, ``reward_margin``, ``chosen_reward``/``rejected_reward`` (``β·ℓ``),
      ``logps_chosen``/``logps_rejected`` (sums), ``nll``, ``num_pairs``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 2)))
      >>> lp = jnp.array([[-2.0, -3.0], [-3.0, -3.0]])
      >>> round(float(losses.simpo(beta=2.0, gamma=1.0)(lp, b)[0]), 5)
      0.69315
    """
    where = "simpo"
    beta = check_number(where, "beta", beta, low=0.0, low_open=True)
    gamma = check_number(where, "gamma", gamma, low=0.0)
    eps = _check_smoothing(where, "simpo", label_smoothing, _CPO_SMOOTHING)
    return _reference_free(
        where=where,
        kind="simpo",
        name="simpo",
        config=dict(beta=beta, gamma=gamma, label_smoothing=eps),
        beta=beta,
        loss_type="simpo",
        eps=eps,
        gamma=gamma,
        cpo_alpha=0.0,
        alpha=0.0,
    )


# -- ORPO -----------------------------------------------------------------------------------------


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 − eˣ)`` for ``x < 0``: ``log1p(−eˣ)`` below ``−ln 2``, else ``log(−expm1(x))``."""
    low = x < -math.log(2.0)
    x_low = jnp.where(low, x, -1.0)
    x_high = jnp.where(low, -1.0, x)
    return jnp.where(low, jnp.log1p(-jnp.exp(x_low)), jnp.log(-jnp.expm1(x_high)))


def orpo(*, beta: float = 0.1) -> Term:
    """ORPO: odds-ratio preference optimization (reference-free), over interleaved pairs.

    With ``ℓ_c = S_c/N_c``, ``ℓ_r = S_r/N_r`` (mean token logprobs, clamped at
    ``ORPO_MAX_MEAN_LOGPROB`` = −1e-6 so that ``log(1 − e^ℓ)`` is finite; the gradient is 0 above
    it) and ``log1mexp(ℓ) = log(1 − e^ℓ)``::

        lor    = (ℓ_c − ℓ_r) − (log1mexp(ℓ_c) − log1mexp(ℓ_r))
        ℓ_pair = NLL_c − β·logσ(lor),   NLL_c = −S_c/N_c

    and the value is the mean over pairs (``P = num_rows/2``, module docstring), i.e. TRL's
    ``NLL − β·mean(logσ(lor))`` with β 0.1.

    Departures: TRL's NLL covers the chosen **prompt + response** tokens (its code comment) as one
    token mean over the batch; here it is the chosen completion's action tokens (prompt tokens are
    in no mask by this package's convention; fw-ai's ``NLL_response``), averaged per pair so that
    micro-batching is exact. fw-ai clamps the means to [−50, −1e-6]; only the upper clamp is kept
    (it is what keeps ``log1mexp`` finite), and it sums over pairs with λ multiplying
    ``−logσ(lor)`` — ``P·orpo(beta=λ)`` when its NLL is a per-pair token mean.

    Source: huggingface/trl ``trl/experimental/orpo/orpo_trainer.py::odds_ratio_loss``;
    fw-ai/cookbook ``training/utils/losses.py::make_batch_orpo_loss_fn``;
    docs/sources.md#preference-terms.

    Args:
      beta: β > 0, the weight of the odds-ratio term (TRL default 0.1).

    Returns:
      A pair `Term` (reads ``action_mask``, ``num_rows``). Metrics: ``loss``,
      ``reward_accuracy``, ``reward_margin``, ``chosen_reward``/``rejected_reward`` (``β·ℓ``),
      ``logps_chosen``/``logps_rejected`` (sums), ``nll``, ``log_odds_ratio`` (mean
      ``logσ(lor)``), ``log_odds_chosen`` (mean ``lor``), ``num_pairs``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 1)))
      >>> loss, m = losses.orpo(beta=0.1)(jnp.array([[-0.5], [-1.0]]), b)
      >>> round(float(m["log_odds_ratio"]), 5), round(float(loss - m["nll"]), 5)
      (-0.3203, 0.03203)
    """
    where = "orpo"
    beta = check_number(where, "beta", beta, low=0.0, low_open=True)

    def per_pair(st):
        mc = jnp.minimum(st["s_c"] / st["n_c"], ORPO_MAX_MEAN_LOGPROB)
        mr = jnp.minimum(st["s_r"] / st["n_r"], ORPO_MAX_MEAN_LOGPROB)
        lor = (mc - mr) - (_log1mexp(mc) - _log1mexp(mr))
        log_odds = jax.nn.log_sigmoid(lor)
        nll = -st["s_c"] / st["n_c"]
        loss = nll - beta * log_odds
        extra = {"nll": nll, "log_odds_ratio": log_odds, "log_odds_chosen": lor}
        return loss, None, beta * mc, beta * mr, extra

    return _pair_term(
        name="orpo", kind="orpo", config=dict(beta=beta), with_ref=False, per_pair=per_pair
    )


# -- KTO ------------------------------------------------------------------------------------------


def kto(
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> Term:
    """KTO (Kahneman-Tversky optimization) over unpaired rows labelled desirable/undesirable.

    Row ``i`` has the log-ratio ``u_i = S_i − R_i`` and the label ``y_i = labels[i]`` (1 =
    desirable). With ``z0 = batch.kl_baseline`` (0-d, used as given)::

        desirable    ℓ_i = w_d·(1 − σ(β·(u_i − z0)))
        undesirable  ℓ_i = w_u·(1 − σ(β·(z0 − u_i)))
        L = Σ_i ℓ_i / num_rows

    ``num_rows`` is carried (`losses.split_batch`) or counted (rows with an action token), so this
    is TRL's ``nanmean`` over all rows and exact under micro-batching with any row split (rows are
    not pairs). ``loss_type="apo_zero_unpaired"`` sets ``z0 = 0`` and does not read
    ``kl_baseline``: ``1 − σ(β·u)`` and ``σ(β·u)``.

    ``z0`` must be computed once over the **whole optimizer batch** — never per micro-batch —
    with `kto_kl_baseline` and set with ``batch.replace(kl_baseline=z0)`` before splitting; it is
    a stop-gradient constant here, as in TRL (``z0 = clamp(mean(sg(S_KL − R_KL)), min=0)``).

    Source: huggingface/trl ``trl/trainer/kto_trainer.py`` (defaults β 0.1, ``desirable_weight``
    and ``undesirable_weight`` 1.0); docs/sources.md#preference-terms.

    Args:
      beta: β > 0.
      desirable_weight: ``w_d ≥ 0``.
      undesirable_weight: ``w_u ≥ 0``.
      loss_type: one of ``KTO_LOSS_TYPES``.

    Returns:
      A `Term` reading ``action_mask``, ``ref_logprobs``, ``labels``, ``kl_baseline`` (``kto``)
      and ``num_rows``; ``validate`` checks labels, ``kl_baseline`` and non-empty rows. Metrics:
      ``loss``, ``chosen_reward``/``rejected_reward`` (mean ``β·u`` over desirable/undesirable
      rows), ``reward_margin`` (their difference), ``kl_baseline``, ``num_desirable``,
      ``num_undesirable``.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 1)), ref_logprobs=jnp.array([[-12.], [-14.]]),
      ...                  labels=jnp.array([1., 0.]), kl_baseline=jnp.array(0.2))
      >>> round(float(losses.kto()(jnp.array([[-10.], [-15.]]), b)[0]), 5)
      0.46258
    """
    where = "kto"
    beta = check_number(where, "beta", beta, low=0.0, low_open=True)
    w_d = check_number(where, "desirable_weight", desirable_weight, low=0.0)
    w_u = check_number(where, "undesirable_weight", undesirable_weight, low=0.0)
    check_choice(where, "loss_type", loss_type, KTO_LOSS_TYPES)
    with_baseline = loss_type == "kto"

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        s, r, n = _row_stats(lp, batch, True, where)
        ok = n > 0
        u = safe(s - r, ok)
        labels = require(batch, "labels", where)
        desirable = ok & (labels > 0)
        undesirable = ok & ~(labels > 0)
        if with_baseline:
            z0 = jnp.asarray(require(batch, "kl_baseline", where), lp.dtype)
        else:
            z0 = jnp.zeros((), lp.dtype)
        loss_d = w_d * (1.0 - jax.nn.sigmoid(beta * (u - z0)))
        loss_u = w_u * (1.0 - jax.nn.sigmoid(beta * (z0 - u)))
        per_row = jnp.where(desirable, loss_d, jnp.where(undesirable, loss_u, 0.0))
        rows = jnp.maximum(jnp.asarray(_num_rows(batch), lp.dtype), 1.0)
        loss = jnp.sum(per_row) / rows
        chosen = _mean_over(beta * u, desirable)
        rejected = _mean_over(beta * u, undesirable)
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "chosen_reward": chosen,
            "rejected_reward": rejected,
            "reward_margin": chosen - rejected,
            "kl_baseline": jax.lax.stop_gradient(z0),
            "num_desirable": count(desirable.astype(lp.dtype)),
            "num_undesirable": count(undesirable.astype(lp.dtype)),
        }
        return loss, metrics

    reads = {"action_mask", "obs_mask", "num_rows", "ref_logprobs", "labels"}
    requires = {"action_mask", "ref_logprobs", "labels"}
    if with_baseline:
        reads.add("kl_baseline")
        requires.add("kl_baseline")
    return Term(
        name="kto",
        fn=loss_fn,
        kind="kto",
        config=dict(beta=beta, desirable_weight=w_d, undesirable_weight=w_u, loss_type=loss_type),
        reads=frozenset(reads),
        requires=frozenset(requires),
        twin=None,
        validate=_kto_validator(where, with_baseline),
    )


def kto_kl_baseline(logprobs: Any, batch: Batch) -> jax.Array:
    """KTO's batch KL baseline ``z0 = max(0, mean_i sg(S_KL,i − R_KL,i))`` (``Batch.kl_baseline``).

    ``S_KL,i`` and ``R_KL,i`` are the policy and reference logprobs (summed over the action
    tokens) of row ``i``'s **mismatched** completion: TRL pairs each prompt with another row's
    completion by rotating the completions one place (prompt ``i`` with completion ``i − 1``
    mod ``B``; it needs ``B > 1``). The mean is over this batch's rows with an action token.

    What the caller must do, once per optimizer step and before `losses.split_batch`:

    1. build the KL sequences (prompt ``i`` + completion ``i − 1`` mod ``B``, over the whole
       optimizer batch — all data-parallel shards: TRL gathers before the mean);
    2. run the current policy (no gradient) and the reference on them, giving ``logprobs`` and
       a ``Batch`` with their ``action_mask`` and ``ref_logprobs``;
    3. ``batch = batch.replace(kl_baseline=losses.kto_kl_baseline(kl_logprobs, kl_batch))``,
       then split: every micro-batch carries the same ``z0`` (the field is never sliced).

    Source: huggingface/trl ``trl/trainer/kto_trainer.py`` (``kl = (policy_KL_logps −
    reference_KL_logps).mean().clamp(min=0)`` after gathering); docs/sources.md#preference-terms.

    Args:
      logprobs: policy logprobs of the KL (mismatched) sequences; float[B, T].
      batch: their `Batch` (``action_mask``, ``ref_logprobs``); float[B, T].

    Returns:
      0-d ``z0 ≥ 0`` (stop-gradient). Jittable.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((2, 1)), ref_logprobs=jnp.array([[-1.5], [-2.1]]))
      >>> round(float(losses.kto_kl_baseline(jnp.array([[-1.0], [-2.2]]), b)), 5)
      0.2
    """
    where = "kto_kl_baseline"
    lp = jax.lax.stop_gradient(check_logprobs_shape(logprobs, batch))
    batch = jax.lax.stop_gradient(batch)
    s, r, n = _row_stats(lp, batch, True, where)
    ok = n > 0
    mean = jnp.sum(safe(s - r, ok)) / jnp.maximum(count(ok.astype(lp.dtype)), 1.0)
    return jnp.maximum(mean, 0.0)
