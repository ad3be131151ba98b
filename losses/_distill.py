"""Distillation terms: sampled-token reverse KL to a teacher, and top-K divergences.

Two families (docs/sources.md#distillation (and #entropy)):

* **Sampled-token reverse KL** (on-policy distillation, OPD). The student samples the tokens;
  the teacher scores them (``batch.teacher_logprobs``, float[B, T]). The per-token reverse KL
  estimate is ``s - t`` (student minus teacher logprob of the sampled token).
  `reverse_kl_distillation` turns it into a loss in one of four forms (Tinker cookbook
  score-function / importance-sampling, verl's direct ``k2``/``k3``, prime-rl ``ref_kl``), and
  `distillation_advantages` gives the Tinker cookbook's per-token advantages (with its γ
  discount) for any policy term, e.g. the built-in ``importance_sampling`` kernel.
* **Top-K divergences** over the teacher's top-K tokens. These terms take the **student's
  logprobs at the teacher's top-K ids, float[B, T, K]** as their first (differentiable)
  argument instead of the usual float[B, T], with ``batch.teacher_topk_logprobs`` [B, T, K].
  `topk_forward_kl`, `topk_reverse_kl` and `topk_jsd` choose how the K entries become
  distributions: raw (truncated), with a (K+1)-th tail bucket ``log(1 - Σ_k e^{x_k})``, or
  renormalised over K. `topk_entropy` gives the §7 top-K entropy approximations. Their
  gradient is the closed form (`jax.custom_jvp`), one elementwise pass over the [B, T, K]
  inputs; each per-token sum over the K entries is one fused pass (see `_entries`).

Every term reduces its per-token loss over ``action_mask`` with the shared reductions
(``reduction=``, default ``token_mean``), reading the carried normalizers, so `split_batch` is
exact. Masked positions may hold inf/nan (all K entries of a top-K position): they are replaced
before any arithmetic and get an exactly-zero gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from losses._batch import Batch, Term, check_logprobs_shape, count, reduction_reads, require
from losses._checks import MAX_LOGPROB
from losses._common import (
    check_choice,
    check_number,
    clamped_log_ratio,
    kl_penalty,
    masked_mean,
    safe,
)
from losses._reductions import term_weights, validate_reduction

#: The forms of `reverse_kl_distillation`.
REVERSE_KL_FORMS = ("importance_sampling", "k2", "k3", "ref_kl")
#: How the top-K terms renormalise the K entries (`topk_forward_kl` accepts all three).
TOPK_RENORMALIZE = ("none", "teacher", "both")
#: The top-K entropy approximations of `topk_entropy` (docs/sources.md#entropy).
TOPK_ENTROPY_APPROX = ("truncated", "tail", "renormalized")
#: Upper clamp of ``log Σ_k e^{x_k}`` before the tail bucket ``log(1 - Σ_k e^{x_k})`` (TRL
#: ``_add_tail_bucket``): keeps the tail finite when the K entries hold all the mass.
TAIL_LOG_MASS_MAX = -1e-7
#: Host-side tolerance on a top-K probability mass ``Σ_k e^{x_k} ≤ 1`` (float32 rounding).
TOPK_MASS_TOL = 1e-3

_PRIME_RL_KL_TAU = 1e-3
_PRIME_RL_PROB_DELTA_LOW = 0.2


# -- sampled-token reverse KL --------------------------------------------------------------------


def _discounted_future_sum(x: jax.Array, discount: float) -> jax.Array:
    """``y_t = Σ_{u ≥ t} discount^(u - t)·x_u`` along the last axis (a parallel linear scan)."""
    if discount == 0.0:
        return x
    gains = jnp.full_like(x, discount)

    def combine(later, earlier):
        g_later, y_later = later
        g_earlier, y_earlier = earlier
        return g_later * g_earlier, y_earlier + g_earlier * y_later

    _, y = jax.lax.associative_scan(combine, (gains, x), reverse=True, axis=x.ndim - 1)
    return y


def distillation_advantages(
    student_logprobs: Any,
    teacher_logprobs: Any,
    action_mask: Any,
    *,
    coef: float = 1.0,
    discount: float = 0.0,
) -> jax.Array:
    """Per-token on-policy distillation advantages, the Tinker cookbook's form.

    ``rkl_t = (s_t - t_t)·m_t`` is the sampled-token reverse KL; the advantage is its negative,
    optionally summed over the future with a discount γ::

        A_t = Σ_{u ≥ t} γ^(u - t) · (-coef · rkl_u)          (γ = 0: A_t = -coef·rkl_t)

    then zeroed off the action mask. Source: tinker-cookbook
    ``distillation/train_on_policy.py::incorporate_kl_penalty`` (``kl_penalty_coef`` 1.0,
    ``kl_discount_factor`` 0; ``s`` = the **sampler**'s logprobs, so the advantages are data).
    The discount runs over positions (as the cookbook's ``discounted_future_sum`` runs over a
    datum's positions), so an observation token between two turns still counts one step of γ.
    γ = 1 gives the exact sequence-level reverse-KL gradient under the ``importance_sampling``
    loss on-policy (§5); γ = 0 is the per-token form. Add the result to the task advantages
    (the cookbook's ``A += ...``) and run ``losses.importance_sampling`` — or the server's
    ``importance_sampling`` kernel — on it: that is exactly
    ``losses.reverse_kl_distillation(coef=coef, discount=γ)`` folded with the task term.

    Departure: the cookbook does not re-mask after the discount (with γ > 0 a non-action
    position before a later action gets a non-zero advantage); here it is 0 there.

    Args:
      student_logprobs: the student's (sampler's) logprobs of the sampled tokens; float[B, T]
        (any leading shape, time last).
      teacher_logprobs: the teacher's logprobs of the same tokens; float[B, T].
      action_mask: 1.0 on student-generated tokens, else 0.0; float[B, T]. Masked entries of the
        logprobs may hold inf/nan.
      coef: the KL coefficient (``kl_penalty_coef``), ``≥ 0``.
      discount: γ ∈ [0, 1].

    Returns:
      float[B, T] advantages, 0 off the action mask.

    Example:
      >>> import jax.numpy as jnp, losses
      >>> s, t = jnp.array([[-1., -.5, -2]]), jnp.array([[-1.2, -.4, -1]])
      >>> [round(float(a), 4) for a in losses.distillation_advantages(s, t, jnp.ones((1, 3)),
      ...                                                             discount=0.5)[0]]
      [0.1, 0.6, 1.0]
    """
    where = "distillation_advantages"
    coef = check_number(where, "coef", coef, low=0.0)
    discount = check_number(where, "discount", discount, low=0.0, high=1.0)
    s = jnp.asarray(student_logprobs)
    t = jnp.asarray(teacher_logprobs)
    m = jnp.asarray(action_mask)
    if s.shape != t.shape or s.shape != m.shape or s.ndim < 1:
        raise ValueError(
            f"{where}: student_logprobs {tuple(s.shape)}, teacher_logprobs {tuple(t.shape)} and "
            f"action_mask {tuple(m.shape)} must have the same [B, T] shape"
        )
    dtype = jnp.result_type(s.dtype, t.dtype, jnp.float32)
    s, t = s.astype(dtype), t.astype(dtype)
    valid = m > 0
    rkl = safe(s, valid) - safe(t, valid)
    adv = _discounted_future_sum(-coef * rkl, discount)
    return safe(adv, valid)


def reverse_kl_distillation(
    *,
    form: str = "importance_sampling",
    coef: float = 1.0,
    discount: float = 0.0,
    kl_tau: float | None = None,
    prob_delta_low: float | None = None,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
    max_log_ratio: float = 20.0,
) -> Term:
    """Sampled-token reverse KL to a teacher (on-policy distillation), in one of four forms.

    Per action token, with ``p`` the current student logprob (differentiable), ``q =
    old_logprobs`` (the sampler's, stop-gradient; defaults to ``sampling_logprobs``), ``t =
    teacher_logprobs``, ``r = exp(clip(p - q, ±max_log_ratio))`` and ``δ = clip(p - t,
    ±max_log_ratio)``; ``L = coef·Σ w·ℓ`` with ``w`` the reduction's weights and, per form:

    * ``"importance_sampling"`` (default) — ``ℓ = -r·A`` with ``A`` =
      `distillation_advantages` ``(q, t, action_mask, discount=discount)`` (data), gradient
      ``-r·A``; at ``p = q``, ``γ = 0`` the value is ``Σ w·(q - t)`` and the gradient ``w·(q -
      t)``. Source: tinker-cookbook ``distillation/train_on_policy.py`` (advantages) + the
      ``importance_sampling`` loss ``-Σ exp(p - q)·A``.
    * ``"k2"`` — ``ℓ = δ²/2``, gradient ``δ``. verl ``distillation_loss`` ``loss_mode=k2``.
    * ``"k3"`` — ``ℓ = e^{-δ} + δ - 1``, gradient ``1 - e^{-δ}``. verl ``loss_mode=k3``, its
      YAML default (``use_policy_gradient=false``: backpropagated directly).
    * ``"ref_kl"`` — ``ℓ = -keep·sg(t - p)·r + kl_tau·(log r)²`` with ``keep = [e^p - e^q ≥
      -prob_delta_low]``, gradient ``-keep·(t - p)·r + 2·kl_tau·log r``. prime-rl
      ``ref_kl_loss_fn``.

    What the expected gradient descends (docs/sources.md#kl-variants; checked by exact enumeration in
    tests/test_distill.py): ``importance_sampling`` and ``k2`` on-policy (tokens sampled from
    ``p``), and ``ref_kl`` also off-policy (its ``sg(t - p)`` uses the current ``p`` and ``r``
    reweights the sample; the drift term adds ``2·kl_tau·log r``, and ``keep`` drops tokens),
    descend the reverse KL(p‖q_teacher); ``importance_sampling``
    off-policy is biased (its ``A`` is frozen at the sampler's logprobs); ``k3`` backpropagated
    directly descends the **forward** KL(q_teacher‖p) (verl's default; §2.1). With
    ``discount = 1`` the ``importance_sampling`` form is the exact sequence-level reverse-KL
    gradient on-policy.

    Twin: none (``Term.twin`` is None). The ``importance_sampling`` form *is* the Tinker/
    Fireworks ``importance_sampling`` kernel with ``A = coef·(t - q)`` (§8) — but that kernel
    reads the datum's advantages, and this term reads ``teacher_logprobs``, not
    ``batch.advantages``, so a runner folding ``batch.advantages`` into the kernel would compute
    something else. The exact server route is ``losses.importance_sampling(reduction=...)`` on
    ``batch.replace(advantages=A_task + losses.distillation_advantages(q, t, action_mask,
    coef=coef, discount=γ))``, whose twin is the kernel (tested equal to this term).

    Reductions (default ``token_mean``): the cookbook's kernel is a raw token sum
    (``token_sum``); verl uses its ``loss_agg_mode`` (default ``token-mean``); prime-rl divides
    by its own micro-batch's token count — here every reduction reads the optimizer batch's
    normalizers, so micro-batches add up exactly. Departures: verl also clamps the k3 value to
    ±10 (which zeroes its gradient beyond) and has ``loss_max_clamp``/``log_prob_min_clamp``;
    here only ``δ`` is clamped to ``±max_log_ratio`` (20, verl's exponent clamp). prime-rl does
    not clamp ``log r``; here it is clamped at ``±max_log_ratio``.

    Args:
      form: one of `REVERSE_KL_FORMS`.
      coef: weight of the term (the cookbook's ``kl_penalty_coef``, 1.0), ``≥ 0``.
      discount: γ ∈ [0, 1] of the ``importance_sampling`` form (``kl_discount_factor``, 0).
      kl_tau: ``ref_kl`` only: weight of the ``(log r)²`` drift term (prime-rl 1e-3).
      prob_delta_low: ``ref_kl`` only: drop tokens whose probability fell more than this below
        the sampler's (prime-rl 0.2, one-sided).
      reduction: one of ``losses.REDUCTIONS``.
      max_tokens: the ``seq_mean_token_sum_norm`` constant.
      max_log_ratio: clamp of ``p - q`` and ``p - t`` before ``exp``.

    Returns:
      A `Term` reading ``action_mask``, ``teacher_logprobs``, ``old_logprobs``
      (``importance_sampling``, ``ref_kl``) and the reduction's normalizers. Metrics: ``loss``,
      ``teacher_kl`` (mean of ``p - t`` over action tokens; the cookbook's metric on-policy),
      ``num_tokens``; ``ratio_mean`` and ``adv_mean`` (``importance_sampling``); ``ratio_mean``
      and ``kept_frac`` (``ref_kl``).

    Example:
      >>> import jax.numpy as jnp, losses
      >>> s, t = jnp.array([[-1., -.5, -2]]), jnp.array([[-1.2, -.4, -1]])
      >>> b = losses.Batch(action_mask=jnp.ones((1, 3)), sampling_logprobs=s, teacher_logprobs=t)
      >>> round(float(losses.reverse_kl_distillation(reduction="token_sum")(s, b)[0]), 4)
      -0.9
    """
    where = "reverse_kl_distillation"
    check_choice(where, "form", form, REVERSE_KL_FORMS)
    validate_reduction(reduction, max_tokens, where=where)
    coef = check_number(where, "coef", coef, low=0.0)
    discount = check_number(where, "discount", discount, low=0.0, high=1.0)
    mlr = check_number(where, "max_log_ratio", max_log_ratio, low=0.0, low_open=True)
    if discount != 0.0 and form != "importance_sampling":
        raise ValueError(
            f"{where}: discount applies only to form='importance_sampling' (the advantage-shaping "
            f"form), got discount={discount!r} with form={form!r}"
        )
    if form == "ref_kl":
        kl_tau = check_number(
            where, "kl_tau", _PRIME_RL_KL_TAU if kl_tau is None else kl_tau, low=0.0
        )
        prob_delta_low = check_number(
            where,
            "prob_delta_low",
            _PRIME_RL_PROB_DELTA_LOW if prob_delta_low is None else prob_delta_low,
            low=0.0,
        )
    else:
        for name, value in (("kl_tau", kl_tau), ("prob_delta_low", prob_delta_low)):
            if value is not None:
                raise ValueError(
                    f"{where}: {name} applies only to form='ref_kl', got {name}={value!r} with "
                    f"form={form!r}"
                )
    anchored = form in ("importance_sampling", "ref_kl")
    requires = {"action_mask", "teacher_logprobs"} | ({"old_logprobs"} if anchored else set())

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        lp = check_logprobs_shape(logprobs, batch)
        batch = jax.lax.stop_gradient(batch)
        valid = batch.action_mask > 0
        teacher = require(batch, "teacher_logprobs", where)
        w = term_weights(batch, "action", reduction, max_tokens)
        lp_v = safe(lp, valid)
        t_v = safe(teacher, valid)
        metrics: dict[str, jax.Array] = {}
        if anchored:
            anchor = require(batch, "old_logprobs", where)
            log_ratio = clamped_log_ratio(lp, anchor, valid, mlr)
            ratio = jnp.exp(log_ratio)
            metrics["ratio_mean"] = masked_mean(ratio, valid)
        if form == "importance_sampling":
            adv = distillation_advantages(anchor, teacher, batch.action_mask, discount=discount)
            terms = -ratio * adv
            metrics["adv_mean"] = masked_mean(adv, valid)
        elif form == "ref_kl":
            assert kl_tau is not None and prob_delta_low is not None  # checked above
            q_v = safe(jax.lax.stop_gradient(anchor), valid)
            p_sg = jax.lax.stop_gradient(lp_v)
            keep = valid & (jnp.exp(p_sg) - jnp.exp(q_v) >= -prob_delta_low)
            adv = jax.lax.stop_gradient(t_v - lp_v)
            terms = -keep.astype(lp.dtype) * adv * ratio + kl_tau * jnp.square(log_ratio)
            metrics["kept_frac"] = masked_mean(keep.astype(lp.dtype), valid)
        else:
            terms = kl_penalty(lp, teacher, valid, estimator=form, max_log_ratio=mlr)
        terms = safe(terms, valid)
        loss = coef * jnp.sum(w * terms)
        metrics.update(
            {
                "loss": jax.lax.stop_gradient(loss),
                "teacher_kl": masked_mean(lp_v - t_v, valid),
                "num_tokens": count(valid.astype(lp.dtype)),
            }
        )
        return loss, metrics

    return Term(
        name="distill",
        fn=loss_fn,
        kind="reverse_kl_distillation",
        config=dict(
            form=form,
            coef=coef,
            discount=discount,
            kl_tau=kl_tau,
            prob_delta_low=prob_delta_low,
            reduction=reduction,
            max_tokens=max_tokens,
            max_log_ratio=mlr,
        ),
        reads=frozenset(requires) | reduction_reads(reduction, "action"),
        requires=frozenset(requires),
        is_zero=coef == 0.0,
        twin=None,
    )


# -- top-K divergences ---------------------------------------------------------------------------


def _log_tail(x_K: jax.Array) -> jax.Array:
    """``log(1 - Σ_k e^{x_k})`` over the last axis, keepdims; ``Σ`` clamped below 1 (TRL)."""
    log_mass = jnp.minimum(jax.nn.logsumexp(x_K, axis=-1, keepdims=True), TAIL_LOG_MASS_MAX)
    return jnp.log(-jnp.expm1(log_mass))


def _with_tail(x_K: jax.Array) -> jax.Array:
    return jnp.concatenate([x_K, _log_tail(x_K)], axis=-1)


def _renormalized(x_K: jax.Array) -> jax.Array:
    return x_K - jax.nn.logsumexp(x_K, axis=-1, keepdims=True)


#: Largest K whose per-token sums are unrolled over the K entries (see `_entries`); a larger K
#: sums over the axis.
_UNROLL_MAX_K = 32


def _entries(x: jax.Array, valid: jax.Array, fill: float = 0.0) -> tuple[jax.Array, ...]:
    """The K entries of ``x[..., K]``, ``fill`` where not ``valid[...]``: ``[..., 1]`` slices
    (``K ≤ _UNROLL_MAX_K``), else ``(x,)``.

    A per-token sum over the slices is a chain of elementwise adds: XLA fuses it, with the
    exp/log of every entry, into one pass over the ``[..., K]`` inputs that writes only the
    ``[..., 1]`` result. An axis reduction instead takes its operand materialised (XLA:CPU's
    reduction kernels fuse no transcendental), one ``[..., K]`` buffer per sum. The selects
    also keep XLA from turning ``exp`` of the slices back into an ``exp`` of the whole array.
    """
    k = x.shape[-1]
    parts = [x[..., i : i + 1] for i in range(k)] if k <= _UNROLL_MAX_K else [x]
    v = valid[..., None]
    return tuple(jnp.where(v, e, jnp.asarray(fill, x.dtype)) for e in parts)


def _esum(xs: Sequence[jax.Array]) -> jax.Array:
    """``Σ_k`` over `_entries`, keepdims."""
    parts = [x if x.shape[-1] == 1 else jnp.sum(x, axis=-1, keepdims=True) for x in xs]
    return functools.reduce(jnp.add, parts)


def _elogsumexp(x: jax.Array, xs: Sequence[jax.Array], valid: jax.Array) -> jax.Array:
    """``log Σ_k e^{x_k}`` over ``xs = _entries(x, valid)``, keepdims, as `jax.nn.logsumexp`
    computes it: shifted by the max (of the raw ``x``; 0 where masked or not finite)."""
    k = x.shape[-1]
    parts = [x[..., i : i + 1] for i in range(k)] if k <= _UNROLL_MAX_K else [x]
    parts = [e if e.shape[-1] == 1 else jnp.max(e, axis=-1, keepdims=True) for e in parts]
    m = functools.reduce(jnp.maximum, parts)
    m = jnp.where(valid[..., None] & jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    return jnp.log(_esum([jnp.exp(e - m) for e in xs])) + m


def _min_gate(x: jax.Array, bound: float) -> jax.Array:
    """``∂ min(x, bound) / ∂x`` as JAX defines it: 1 below, ½ at the bound, 0 above."""
    return jnp.where(x < bound, 1.0, jnp.where(x == bound, 0.5, 0.0)).astype(x.dtype)


def _sanitized(x: jax.Array) -> jax.Array:
    """``x`` where it can be a log-probability (``≤ 1``; ``≥ -max/16``, so that no product of
    the gradient overflows), else 0 (nan, +inf, huge) or ``-max/16`` (-inf).

    The gradient's pass reads the inputs through this instead of masking them: its value is
    multiplied by 0 off the mask, where this keeps it finite, and on the mask it changes
    nothing that `check_batch` accepts (a teacher logprob below ``-max/16``, ~ -2e37 in
    float32, would change only the reverse KL's gradient). XLA:CPU runs this elementwise test
    at full speed in a loop with transcendentals, and a ``[B, T]`` mask broadcast over K at
    half the speed.
    """
    floor = float(jnp.finfo(x.dtype).max) / 16
    return jnp.maximum(jnp.where(x <= 1.0, x, jnp.zeros((), x.dtype)), -floor)


class _TopKSpec(NamedTuple):
    """What a top-K term computes: the divergence, the support of each side, the options."""

    kind: str  # "forward" KL(T‖S), "reverse" KL(S‖T) or "jsd"
    student: str  # the student's support: "raw", "renormalized" or "tail"
    teacher: str  # the teacher's support
    beta: float = 0.5  # "jsd": β ∈ (0, 1)
    clamp: bool = False  # verl: max(ℓ, 0)


def _support(x: jax.Array, xs: Sequence[jax.Array], valid: jax.Array, how: str):
    """``(log-entries, log-normaliser c, tail log L, ρ)`` of one side, from ``xs =
    _entries(x, valid)``.

    ``renormalized``: the entries ``x_k - c`` with ``c = log Σ e^x``. ``tail``: the entries and
    ``L = log(1 - e^{min(c, TAIL_LOG_MASS_MAX)})`` (TRL's clamp), whose derivative in ``x_k`` is
    ``ρ·e^{x_k}`` with ``ρ = gate / expm1(min(c, ·))`` (0 on the clamp).
    """
    if how == "raw":
        return tuple(xs), None, None, None
    lse = _elogsumexp(x, xs, valid)
    if how == "renormalized":
        return tuple(e - lse for e in xs), lse, None, None
    y = jnp.minimum(lse, TAIL_LOG_MASS_MAX)
    return tuple(xs), None, jnp.log(-jnp.expm1(y)), _min_gate(lse, TAIL_LOG_MASS_MAX) / jnp.expm1(y)


def _kl_entries(la, lb, tail_a=None, tail_b=None) -> jax.Array:
    """``Σ_k e^{a_k}·(a_k - b_k)`` (plus the tail bucket's term), keepdims."""
    out = _esum([jnp.exp(a) * (a - b) for a, b in zip(la, lb, strict=True)])
    if tail_a is not None:
        out = out + jnp.exp(tail_a) * (tail_a - tail_b)
    return out


def _mix(spec: _TopKSpec, ls, lt):
    """``(βe^{lt}, (1-β)e^{ls}, log M)`` elementwise, ``M = βe^{lt} + (1-β)e^{ls}``: two
    ``exp`` and one ``log`` per entry (``logaddexp`` would take a third ``exp`` and a
    ``log1p``), the weights being the KL terms' too. Each ``exp``/``log`` feeds one cheap op
    (a product, a select) that the terms then share: XLA:CPU fuses that into the pass, where
    an ``exp`` read by two ops would be written to memory instead. ``log M`` is 0 where ``M``
    underflows to 0: both weights are 0 there, so every term ``weight·(x - log M)`` is 0, as
    with the exact ``log M``, and its derivatives stay finite."""
    a = spec.beta * jnp.exp(lt)
    b = (1.0 - spec.beta) * jnp.exp(ls)
    m = a + b
    pos = m > 0
    one, zero = jnp.ones((), m.dtype), jnp.zeros((), m.dtype)
    return a, b, jnp.where(pos, jnp.log(jnp.where(pos, m, one)), zero)


def _mix_sum(xs, mixes, tail=None, side=0) -> jax.Array:
    """``Σ_k w_k·(x_k - log M_k)`` over ``xs`` and their ``mixes = [_mix(...)]``, with ``w =
    βe^{lt}`` (``side=0``) or ``(1-β)e^{ls}`` (``side=1``), plus the tail bucket's term for
    ``tail = (x, mix)``, keepdims."""
    out = _esum([mix[side] * (x - mix[2]) for x, mix in zip(xs, mixes, strict=True)])
    if tail is not None:
        x, mix = tail
        out = out + mix[side] * (x - mix[2])
    return out


def _topk_forward(s: jax.Array, t: jax.Array, valid: jax.Array, spec: _TopKSpec):
    """Per-token divergence ``[..., 1]`` (0 where masked; before the clamp), what its gradient
    needs, and the parts of the ``divergence`` metric (`_topk_part_weights`).

    The gradient with respect to the student's log-entries ``ls_k`` is ``a_k`` (forward:
    ``-e^{lt_k}``; reverse: ``e^{ls_k}(ls_k - lt_k + 1)``; JSD: ``(1-β)e^{ls_k}(ls_k -
    lm_k)``). Renormalising the student adds ``-e^{ls_k}·Σ_j a_j`` (stat ``"sa"``: ``-1``
    forward and ``ℓ + 1`` reverse, as ``Σ_k e^{ls_k} = 1``; JSD ``Σ_j a_j = (1-β)·KL(S‖M)``,
    and ``"sa"`` holds ``KL(S‖M)``: its gradient is ``(1-β)e^{ls_k}(ls_k - lm_k - KL(S‖M))``),
    its tail bucket ``b·ρ·e^{s_k}`` with ``b = ∂ℓ/∂L_s`` (stat ``"kappa"``; JSD:
    ``(1-β)e^{ls_k}(ls_k - lm_k + κ/(1-β))``).

    Every statistic the gradient reads is a masked sum that the loss also reduces (or a
    function of the log-normalisers): XLA then writes each once, ``[..., 1]``. The JSD sums
    ``β·KL(T‖M)`` and ``(1-β)·KL(S‖M)`` directly (``ℓ`` is their sum), each entry's weight
    ``βe^{lt_k}`` or ``(1-β)e^{ls_k}`` being the one `_mix` adds into ``M_k``. With the tail
    bucket the gradient reads no ``KL(S‖M)``: ``ℓ`` is one sum, one pass. Renormalised, the
    second sum is a statistic and reads entries filled with -0.0 instead of 0.0 where masked:
    the same values from distinct operations, so that XLA gives it a pass of its own instead
    of materialising the per-entry terms the two sums would share.
    """
    v = valid[..., None]
    ls, cs, tail_s, rho = _support(s, _entries(s, valid), valid, spec.student)
    lt, ct, tail_t, _ = _support(t, _entries(t, valid), valid, spec.teacher)
    stats = {"cs": cs, "ct": ct}
    beta = spec.beta
    if spec.kind == "forward":
        d = safe(_kl_entries(lt, ls, tail_t, tail_s), v)
        b = None if tail_t is None else -jnp.exp(tail_t)
        sa: jax.Array | float = -1.0
    elif spec.kind == "reverse":
        d = safe(_kl_entries(ls, lt, tail_s, tail_t), v)
        b = None if tail_s is None else jnp.exp(tail_s) * (tail_s - tail_t + 1.0)
        sa = d + 1.0
    else:
        mix = [_mix(spec, x, y) for x, y in zip(ls, lt, strict=True)]
        if spec.student == "tail":  # ℓ = β·KL(T‖M) + (1-β)·KL(S‖M): one sum, one pass
            tail_m = _mix(spec, tail_s, tail_t)
            d = _mix_sum(lt, mix, (tail_t, tail_m)) + _mix_sum(ls, mix, (tail_s, tail_m), 1)
            d = safe(d, v)
            parts: tuple[jax.Array, ...] = (d,)
            b = tail_m[1] * (tail_s - tail_m[2])
        else:  # (1-β)·KL(S‖M) is also a statistic: its own pass (entries filled with -0.0)
            ls = tuple(e - cs for e in _entries(s, valid, fill=-0.0))
            lt_s = tuple(e - ct for e in _entries(t, valid, fill=-0.0))
            mix_s = [_mix(spec, x, y) for x, y in zip(ls, lt_s, strict=True)]
            t_m = safe(_mix_sum(lt, mix), v)  # β·KL(T‖M)
            s_m = safe(_mix_sum(ls, mix_s, side=1), v)  # (1-β)·KL(S‖M)
            d = t_m + s_m
            parts = (t_m, s_m)
            sa = s_m / (1.0 - beta)  # KL(S‖M)
    if spec.student == "renormalized":
        stats["sa"] = sa
    if spec.student == "tail":
        stats["kappa"] = b * rho
    if spec.kind != "jsd":  # max(d, 0) = (d + |d|)/2 exactly, by operations the loss does not share
        parts = (d + jnp.abs(d),) if spec.clamp else (d,)
    return d, stats, tuple(p[..., 0] for p in parts)


def _topk_part_weights(spec: _TopKSpec) -> tuple[float, ...]:
    """``ℓ = Σ_i weight_i·part_i`` for the ``parts`` of `_topk_forward` (masked per-token sums:
    ``(β·KL(T‖M), (1-β)·KL(S‖M))`` renormalised JSD, ``(ℓ + |ℓ|)`` under the clamp, ``(ℓ,)``
    otherwise)."""
    if spec.kind == "jsd" and spec.student == "renormalized":
        return (1.0, 1.0)
    return (0.5,) if spec.clamp else (1.0,)


def _topk_grad(s, t, gate, stats, spec: _TopKSpec) -> jax.Array:
    """``∂ℓ/∂s[..., K]`` times ``gate`` (``[..., 1]``, 0 where masked): one elementwise pass."""
    s = _sanitized(s)
    t = _sanitized(t)
    ls = s if stats["cs"] is None else s - stats["cs"]
    lt = t if stats["ct"] is None else t - stats["ct"]
    if spec.kind == "forward":
        g = -jnp.exp(lt)
    elif spec.kind == "reverse":
        g = jnp.exp(ls) * (ls - lt + 1.0)
    else:
        _, w, lm = _mix(spec, ls, lt)  # w = (1-β)e^{ls}, also the correction's e^{ls}
        if spec.student == "renormalized":
            return gate * (w * (ls - lm - stats["sa"]))
        if spec.student == "tail":
            return gate * (w * (ls - lm + stats["kappa"] / (1.0 - spec.beta)))
        return gate * (w * (ls - lm))
    if spec.student == "renormalized":
        g = g - jnp.exp(ls) * stats["sa"]
    elif spec.student == "tail":
        g = g + stats["kappa"] * jnp.exp(s)
    return gate * g


def _topk_gate(d: jax.Array, valid: jax.Array, spec: _TopKSpec) -> jax.Array:
    """The per-token factor of the gradient: 0 where masked, ``∂ max(d, 0)/∂d`` under the clamp."""
    v = valid[..., None].astype(d.dtype)
    return v * _min_gate(-d, 0.0) if spec.clamp else v  # max(d, 0) = -min(-d, 0)


def _topk_out(d: jax.Array, spec: _TopKSpec) -> jax.Array:
    return (jnp.maximum(d, 0.0) if spec.clamp else d)[..., 0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _topk_divergence(s: jax.Array, t: jax.Array, valid: jax.Array, spec: _TopKSpec):
    """``(ℓ, parts)``: the per-token top-K divergence float[B, T] of the student logprobs ``s``
    and the teacher's ``t`` (data: no gradient), both float[B, T, K]; ``valid`` bool[B, T];
    and float[B, T] terms (no gradient) whose `_topk_part_weights` sum is ``ℓ``, for the
    ``divergence`` metric: reducing them, not ``ℓ`` again, lets XLA write each once.

    Masked positions may hold inf/nan in ``s`` and ``t``: the value reads them as 0 (and is 0
    there), the gradient through `_sanitized` (finite, then multiplied by 0: exactly 0). The
    gradient is the closed form of `_topk_forward` (a `jax.custom_jvp`, so forward mode and
    higher derivatives work too): one elementwise pass over ``s`` and ``t`` with per-token
    statistics, where autodiff writes several ``[B, T, K]`` intermediates.
    """
    d, _, parts = _topk_forward(s, t, valid, spec)
    return _topk_out(d, spec), parts


@_topk_divergence.defjvp
def _topk_divergence_jvp(spec: _TopKSpec, primals, tangents):
    s, t, valid = primals
    ds = tangents[0]
    d, stats, parts = _topk_forward(s, t, valid, spec)
    g = _topk_grad(s, t, _topk_gate(d, valid, spec), stats, spec)
    zeros = tuple(jnp.zeros_like(p) for p in parts)
    return (_topk_out(d, spec), parts), (jnp.sum(g * ds, axis=-1), zeros)


def _topk_side_metrics(x: jax.Array, valid: jax.Array, how: str) -> tuple[jax.Array, jax.Array]:
    """``(Σ_k e^{x_k}, topk_entropy)`` per position of one side, float[...] each.

    The entries are filled with -1.0 where masked (any finite value: the metrics are masked
    means), not 0.0: operations distinct from the divergence's, so that XLA computes the
    metrics in passes of their own instead of materialising the per-entry terms both share.
    """
    xs = _entries(x, valid, fill=-1.0)
    lse = _elogsumexp(x, xs, valid)
    lx = tuple(e - lse for e in xs) if how == "renormalized" else xs
    h = -_esum([jnp.exp(e) * e for e in lx])
    if how == "tail":
        tail = jnp.log(-jnp.expm1(jnp.minimum(lse, TAIL_LOG_MASS_MAX)))
        h = h - jnp.exp(tail) * tail
    return jnp.exp(lse)[..., 0], h[..., 0]


def topk_entropy(logprobs: Any, *, approx: str = "truncated") -> jax.Array:
    """Top-K approximations of a distribution's entropy from its top-K logprobs (docs/sources.md#entropy).

    With ``p_k = e^{x_k}`` (sorted or not) and ``τ = 1 - Σ_k p_k``:

    * ``"truncated"``: ``-Σ_k p_k log p_k``, a lower bound on the entropy (exact when K covers
      the support);
    * ``"tail"``: truncated ``- τ log τ``, a tighter lower bound (``Σ`` clamped below 1 as in
      `topk_forward_kl`'s tail bucket);
    * ``"renormalized"``: the entropy of ``p_k / Σ p``; not a bound (tinker-cookbook ``sdft``
      logs it as ``sdft/mean_teacher_entropy`` / ``sdft/student_entropy_mean``).

    Example (§7): ``p = [0.5, 0.3, 0.1, 0.1]``, K = 2: truncated 0.70777, tail 1.02965,
    renormalised 0.66156; with K = 4, truncated = H = 1.16828.

    Args:
      logprobs: top-K logprobs, float[..., K] (e.g. ``batch.teacher_topk_logprobs``).
      approx: one of `TOPK_ENTROPY_APPROX`.

    Returns:
      float[...]: the approximation per position (differentiable in ``logprobs``).

    Example:
      >>> import jax.numpy as jnp, losses
      >>> x = jnp.log(jnp.array([0.5, 0.3]))
      >>> round(float(losses.topk_entropy(x, approx="tail")), 5)
      1.02965
    """
    check_choice("topk_entropy", "approx", approx, TOPK_ENTROPY_APPROX)
    x = jnp.asarray(logprobs)
    if x.ndim < 1:
        raise ValueError(f"topk_entropy: logprobs must have a last axis K, got shape {x.shape}")
    if approx == "tail":
        x = _with_tail(x)
    elif approx == "renormalized":
        x = _renormalized(x)
    return -jnp.sum(jnp.exp(x) * x, axis=-1)


def _check_topk_shape(logprobs: Any, batch: Batch, where: str) -> jax.Array:
    lp = jnp.asarray(logprobs)
    teacher = require(batch, "teacher_topk_logprobs", where)
    expected = tuple(teacher.shape)
    if lp.ndim != 3 or tuple(lp.shape) != expected:
        raise ValueError(
            f"{where}: logprobs has shape {tuple(lp.shape)}, expected [B, T, K]={expected} like "
            "batch.teacher_topk_logprobs (the top-K terms take the student's logprobs at the "
            "teacher's top-K ids, not the [B, T] sampled-token logprobs)"
        )
    if not jnp.issubdtype(lp.dtype, jnp.floating):
        raise ValueError(f"{where}: logprobs must be floating point, got dtype {lp.dtype}")
    return lp


def _topk_validate(where: str):
    """Host rules of the top-K terms: top-K masses ≤ 1; the student logprobs, when given."""

    def check_mass(name: str, x: np.ndarray, action: np.ndarray) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            mass = np.exp(x.astype(np.float64)).sum(axis=2)
        bad = action & ~(mass <= 1.0 + TOPK_MASS_TOL)
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(
                f"{where}: {name}[row {i}, column {j}] has top-K probability mass "
                f"{float(mass[i, j]):.6g} > 1: the K entries must be log-probabilities of "
                "distinct tokens of one distribution"
            )

    def validate(batch: Batch, logprobs: Any) -> None:
        action = np.asarray(batch.action_mask) > 0
        teacher = np.asarray(batch.teacher_topk_logprobs)
        check_mass("teacher_topk_logprobs", teacher, action)
        if logprobs is None:
            return
        lp = np.asarray(logprobs)
        if lp.shape != teacher.shape:
            raise ValueError(
                f"{where}: logprobs has shape {lp.shape}, expected [B, T, K]={teacher.shape} like "
                "batch.teacher_topk_logprobs"
            )
        ok = np.isfinite(lp) & (lp <= MAX_LOGPROB)
        bad = action[..., None] & ~ok
        if bad.any():
            i, j, k = (int(v) for v in np.argwhere(bad)[0])
            raise ValueError(
                f"{where}: logprobs[row {i}, column {j}, k {k}] = {float(lp[i, j, k]):g} on an "
                "action token: log-probabilities must be finite and <= 0"
            )
        check_mass("logprobs", lp, action)

    return validate


def _topk_args(where, coef, renormalize, tail, reduction, max_tokens, allowed):
    validate_reduction(reduction, max_tokens, where=where)
    coef = check_number(where, "coef", coef, low=0.0)
    if not isinstance(tail, bool):
        raise ValueError(f"{where}: tail must be a bool, got {tail!r}")
    if renormalize is None:
        renormalize = "none" if tail else allowed[0]
    check_choice(where, "renormalize", renormalize, allowed)
    if tail and renormalize != "none":
        raise ValueError(
            f"{where}: tail=True adds a (K+1)-th bucket to un-renormalised top-K entries; it "
            f"cannot be combined with renormalize={renormalize!r}"
        )
    if not tail and renormalize == "none" and where != "topk_forward_kl":
        raise ValueError(
            f"{where}: raw truncated top-K entries do not form distributions; use "
            "renormalize='both' or tail=True"
        )
    return coef, renormalize


def _topk_spec(kind: str, renormalize: str, tail: bool, beta: float = 0.5) -> _TopKSpec:
    """The `_TopKSpec` of a constructor's options (TRL's GKD ends: β = 0 → forward KL, β = 1 →
    reverse KL; verl's truncated forward KL clamped at 0)."""
    if tail:
        student, teacher = "tail", "tail"
    else:
        student = "renormalized" if renormalize == "both" else "raw"
        teacher = "raw" if renormalize == "none" else "renormalized"
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward" if beta == 0.0 else "reverse"
    clamp = kind == "forward" and student == teacher == "raw"
    return _TopKSpec(kind, student, teacher, beta, clamp)


def _topk_term(
    *,
    where: str,
    name: str,
    spec: _TopKSpec,
    coef: float,
    reduction: str,
    max_tokens: float | None,
    config: dict,
) -> Term:
    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        s = _check_topk_shape(logprobs, batch, where)
        batch = jax.lax.stop_gradient(batch)
        valid = batch.action_mask > 0
        t = batch.teacher_topk_logprobs.astype(s.dtype)
        d, parts = _topk_divergence(s, t, valid, spec)
        w = term_weights(batch, "action", reduction, max_tokens)
        loss = coef * jnp.sum(w * d)
        t_mass, t_entropy = _topk_side_metrics(t, valid, spec.teacher)
        s_mass, s_entropy = _topk_side_metrics(jax.lax.stop_gradient(s), valid, spec.student)
        n = jnp.maximum(count(valid.astype(s.dtype)), 1.0)
        metrics = {
            "loss": jax.lax.stop_gradient(loss),
            "divergence": jax.lax.stop_gradient(
                sum(c * jnp.sum(p) for c, p in zip(_topk_part_weights(spec), parts, strict=True))
            )
            / n,
            "teacher_mass": masked_mean(t_mass, valid),
            "student_mass": masked_mean(s_mass, valid),
            "teacher_entropy": masked_mean(t_entropy, valid),
            "student_entropy": masked_mean(s_entropy, valid),
            "num_tokens": count(valid.astype(s.dtype)),
        }
        return loss, metrics

    requires = frozenset({"action_mask", "teacher_topk_logprobs"})
    return Term(
        name=name,
        fn=loss_fn,
        kind=where,
        config=config,
        reads=requires | reduction_reads(reduction, "action"),
        requires=requires,
        is_zero=coef == 0.0,
        twin=None,
        validate=_topk_validate(where),
        argument="topk_logprobs",
    )


def topk_forward_kl(
    *,
    coef: float = 1.0,
    renormalize: str | None = None,
    tail: bool = False,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
) -> Term:
    """Forward KL(teacher‖student) over the teacher's top-K tokens.

    Per action token, with student ``s_k`` and teacher ``t_k`` logprobs at the K ids, ``q_k =
    e^{t_k}``, ``p_k = e^{s_k}``, hats for renormalised over K, ``τ`` for tail masses ``1 - Σ``:

    ====================================  ===========================================  ==========
    options                               ``ℓ``                                        anchor
    ====================================  ===========================================  ==========
    ``renormalize="none"`` (default)      ``max(Σ_k q_k (t_k - s_k), 0)``              verl
                                                                                   ``forward_kl_topk``
    ``tail=True``                         ``Σ_k q_k (t_k - s_k) + τ_q log(τ_q/τ_p)``   TRL server
                                                                                   distillation
                                                                                   (``loss_add_tail``)
    ``renormalize="both"``                ``Σ_k q̂_k (log q̂_k - log p̂_k)``             TRL, tail off
    ``renormalize="teacher"``             ``Σ_k q̂_k (log q̂_k - s_k)`` = KL(q̂‖p)      tinker-cookbook
                                                                                   ``sdft.py``
    ====================================  ===========================================  ==========

    verl's truncated sum can be negative (no renormalisation, no tail), so it clamps each token
    at 0 (the gradient is then 0). The tail bucket appends ``log(1 - Σ e^{x})`` (``Σ`` clamped
    to ``≤ e^{-1e-7}`` as TRL does) to both. ``"teacher"`` is sdft's ``cross_entropy`` with
    ``(N, K)`` targets and weights ``q̂``: its gradient ``-q̂_k`` is the same and its value is
    lower by the constant ``H(q̂)`` (this term reports the KL, sdft the cross-entropy). Gradient
    with respect to ``s``: ``-q_k`` (verl, where positive), ``-q_k + τ_q p_k/τ_p`` (tail),
    ``p̂_k - q̂_k`` (both), ``-q̂_k`` (teacher). Reductions (default ``token_mean``): verl's
    ``loss_agg_mode`` (``token-mean``), TRL ``batchmean`` over valid tokens (``token_mean``),
    sdft a raw token sum (``token_sum``). No twin here (``Term.twin`` is None): the
    ``"teacher"`` form is Tinker's ``cross_entropy`` with (N, K) targets (§8), which the
    runner's kernel table does not carry.

    Shapes: ``term(logprobs[B, T, K], batch)``. ``logprobs`` are the student's log-probabilities
    (full-vocabulary log-softmax values) **at the teacher's top-K token ids**, float[B, T, K] —
    the differentiable input of this family, instead of the usual [B, T]; a [B, T] array raises
    ``ValueError``. ``batch.teacher_topk_logprobs`` float[B, T, K] are the teacher's; masking is
    over ``action_mask`` [B, T]. ``check_batch(batch, term=term)`` checks the batch (and that
    the teacher's top-K mass is ≤ 1); ``term.validate(batch, logprobs)`` also checks the student
    logprobs (finite, ≤ 0, mass ≤ 1 on action tokens).

    Args:
      coef: weight of the term, ``≥ 0``.
      renormalize: ``"none"``, ``"teacher"`` or ``"both"``; ``None`` = ``"none"`` (``"none"`` with ``tail=True``).
      tail: append the (K+1)-th tail bucket ``log(1 - Σ_k e^{x_k})`` to both sides (only with
        ``renormalize="none"``).
      reduction: one of ``losses.REDUCTIONS`` over ``action_mask`` (default ``token_mean``).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.

    Returns:
      A `Term` reading ``action_mask``, ``teacher_topk_logprobs`` and the reduction's
      normalizers, with host rules in ``Term.validate``. Metrics: ``loss``, ``divergence`` (mean
      per-token divergence over action tokens, before ``coef``), ``teacher_mass`` /
      ``student_mass`` (mean ``Σ_k e^{x_k}``, as verl logs), ``teacher_entropy`` /
      ``student_entropy`` (`topk_entropy` with the approximation matching the support),
      ``num_tokens``.

    Example (§5: verl, teacher [0.6, 0.2], student [0.3, 0.1] → 0.55452):
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((1, 1)),
      ...                  teacher_topk_logprobs=jnp.log(jnp.array([[[0.6, 0.2]]])))
      >>> s = jnp.log(jnp.array([[[0.3, 0.1]]]))
      >>> round(float(losses.topk_forward_kl()(s, b)[0]), 5)
      0.55452
    """
    where = "topk_forward_kl"
    coef, renormalize = _topk_args(
        where, coef, renormalize, tail, reduction, max_tokens, ("none", "teacher", "both")
    )
    return _topk_term(
        where=where,
        name="topk_forward_kl",
        spec=_topk_spec("forward", renormalize, tail),
        coef=coef,
        reduction=reduction,
        max_tokens=max_tokens,
        config=dict(
            coef=coef,
            renormalize=renormalize,
            tail=tail,
            reduction=reduction,
            max_tokens=max_tokens,
        ),
    )


def topk_reverse_kl(
    *,
    coef: float = 1.0,
    renormalize: str | None = None,
    tail: bool = False,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
) -> Term:
    """Reverse KL(student‖teacher) over the teacher's top-K tokens.

    Per action token: ``renormalize="both"`` (default) ``ℓ = Σ_k p̂_k (log p̂_k - log q̂_k)``,
    both renormalised over the K ids — tinker-cookbook ``sdft.py::reverse_kl_custom_loss``
    (``p̂ = log_softmax`` of the (N, K) student logprobs; its ``Σ p̂·sg(log p̂ - log q̂)`` has
    this exact gradient since ``Σ p̂ = 1``; sdft reduces by a raw token sum); or ``tail=True``:
    the K entries plus a tail bucket on both sides, ``Σ_k p_k (s_k - t_k) + τ_p log(τ_p/τ_q)``
    (TRL's tail bucket applied to the teacher's top-K support; TRL's own reverse path uses the
    sampled token's top-1 support instead). Gradient: ``p̂_k (log p̂_k - log q̂_k - ℓ)``
    (renormalised), ``p_k (s_k - t_k - log τ_p + log τ_q)`` (tail). Raw truncated sums are
    refused (not a divergence).

    Example (§5): student probabilities [0.2, 0.2], teacher [0.6, 0.2] → 0.14384, gradient
    [-0.27465, 0.27465]. Custom only (§8): no twin.

    Shapes: ``term(logprobs[B, T, K], batch)``. ``logprobs`` are the student's log-probabilities
    (full-vocabulary log-softmax values) **at the teacher's top-K token ids**, float[B, T, K] —
    the differentiable input of this family, instead of the usual [B, T]; a [B, T] array raises
    ``ValueError``. ``batch.teacher_topk_logprobs`` float[B, T, K] are the teacher's; masking is
    over ``action_mask`` [B, T]. ``check_batch(batch, term=term)`` checks the batch (and that
    the teacher's top-K mass is ≤ 1); ``term.validate(batch, logprobs)`` also checks the student
    logprobs (finite, ≤ 0, mass ≤ 1 on action tokens).

    Args:
      coef: weight of the term, ``≥ 0``.
      renormalize: ``"both"`` or ``"none"`` (with ``tail=True``); ``None`` = ``"both"`` (``"none"`` with ``tail=True``).
      tail: append the (K+1)-th tail bucket ``log(1 - Σ_k e^{x_k})`` to both sides (only with
        ``renormalize="none"``).
      reduction: one of ``losses.REDUCTIONS`` over ``action_mask`` (default ``token_mean``).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.

    Returns:
      A `Term` reading ``action_mask``, ``teacher_topk_logprobs`` and the reduction's
      normalizers, with host rules in ``Term.validate``. Metrics: ``loss``, ``divergence`` (mean
      per-token divergence over action tokens, before ``coef``), ``teacher_mass`` /
      ``student_mass`` (mean ``Σ_k e^{x_k}``, as verl logs), ``teacher_entropy`` /
      ``student_entropy`` (`topk_entropy` with the approximation matching the support),
      ``num_tokens``.

    Example (§5: student [0.2, 0.2], teacher [0.6, 0.2] → 0.14384):
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((1, 1)),
      ...                  teacher_topk_logprobs=jnp.log(jnp.array([[[0.6, 0.2]]])))
      >>> s = jnp.log(jnp.array([[[0.2, 0.2]]]))
      >>> round(float(losses.topk_reverse_kl()(s, b)[0]), 5)
      0.14384
    """
    where = "topk_reverse_kl"
    coef, renormalize = _topk_args(
        where, coef, renormalize, tail, reduction, max_tokens, ("both", "none")
    )
    return _topk_term(
        where=where,
        name="topk_reverse_kl",
        spec=_topk_spec("reverse", renormalize, tail),
        coef=coef,
        reduction=reduction,
        max_tokens=max_tokens,
        config=dict(
            coef=coef,
            renormalize=renormalize,
            tail=tail,
            reduction=reduction,
            max_tokens=max_tokens,
        ),
    )


def topk_jsd(
    *,
    beta: float = 0.5,
    coef: float = 1.0,
    renormalize: str | None = None,
    tail: bool = False,
    reduction: str = "token_mean",
    max_tokens: float | None = None,
) -> Term:
    """Generalized Jensen-Shannon divergence (TRL GKD) over the teacher's top-K tokens.

    ``ℓ = β·KL(T‖M) + (1-β)·KL(S‖M)`` with ``M = β·T + (1-β)·S``, except ``β = 0`` →
    KL(T‖S) (forward) and ``β = 1`` → KL(S‖T) (reverse), exactly TRL's special cases (so the
    value jumps at the ends: the mixture formula tends to 0 there). ``T`` and ``S`` are the
    teacher's and student's top-K entries renormalised over K (``renormalize="both"``, default;
    TRL ``loss_add_tail=False``) or with a tail bucket (``tail=True``; TRL ``loss_add_tail``).
    With K = the vocabulary this is GKD's full JSD. Sources: TRL ``experimental/gkd``
    (β 0.5, ``batchmean`` over valid tokens = ``token_mean``, the default here) and
    ``DistillationTrainer`` (β 1.0). TRL's ``temperature`` (0.9) scales logits before the
    log-softmax; here the logprobs are taken as given. Gradient (closed form, as autodiff
    would give it): ``(1-β)·S_k(log S_k - log M_k)`` per entry, through the renormalisation
    (``- S_k·Σ_j``) or the tail bucket. No twin (§8).

    Example (§5, vocabulary 3, teacher [0.7, 0.2, 0.1], student [0.4, 0.4, 0.2]): β = 0.5 →
    0.04620, β = 0 → 0.18379, β = 1 → 0.19204.

    Shapes: ``term(logprobs[B, T, K], batch)``. ``logprobs`` are the student's log-probabilities
    (full-vocabulary log-softmax values) **at the teacher's top-K token ids**, float[B, T, K] —
    the differentiable input of this family, instead of the usual [B, T]; a [B, T] array raises
    ``ValueError``. ``batch.teacher_topk_logprobs`` float[B, T, K] are the teacher's; masking is
    over ``action_mask`` [B, T]. ``check_batch(batch, term=term)`` checks the batch (and that
    the teacher's top-K mass is ≤ 1); ``term.validate(batch, logprobs)`` also checks the student
    logprobs (finite, ≤ 0, mass ≤ 1 on action tokens).

    Args:
      beta: β ∈ [0, 1] (TRL GKD 0.5; ``DistillationTrainer`` 1.0).
      coef: weight of the term, ``≥ 0``.
      renormalize: ``"both"`` or ``"none"`` (with ``tail=True``); ``None`` = ``"both"`` (``"none"`` with ``tail=True``).
      tail: append the (K+1)-th tail bucket ``log(1 - Σ_k e^{x_k})`` to both sides (only with
        ``renormalize="none"``).
      reduction: one of ``losses.REDUCTIONS`` over ``action_mask`` (default ``token_mean``).
      max_tokens: the ``seq_mean_token_sum_norm`` constant.

    Returns:
      A `Term` reading ``action_mask``, ``teacher_topk_logprobs`` and the reduction's
      normalizers, with host rules in ``Term.validate``. Metrics: ``loss``, ``divergence`` (mean
      per-token divergence over action tokens, before ``coef``), ``teacher_mass`` /
      ``student_mass`` (mean ``Σ_k e^{x_k}``, as verl logs), ``teacher_entropy`` /
      ``student_entropy`` (`topk_entropy` with the approximation matching the support),
      ``num_tokens``.

    Example (§5, full vocabulary of 3):
      >>> import jax.numpy as jnp, losses
      >>> b = losses.Batch(action_mask=jnp.ones((1, 1)),
      ...                  teacher_topk_logprobs=jnp.log(jnp.array([[[0.7, 0.2, 0.1]]])))
      >>> s = jnp.log(jnp.array([[[0.4, 0.4, 0.2]]]))
      >>> round(float(losses.topk_jsd(beta=0.5)(s, b)[0]), 5)
      0.0462
    """
    where = "topk_jsd"
    beta = check_number(where, "beta", beta, low=0.0, high=1.0)
    coef, renormalize = _topk_args(
        where, coef, renormalize, tail, reduction, max_tokens, ("both", "none")
    )
    return _topk_term(
        where=where,
        name="topk_jsd",
        spec=_topk_spec("jsd", renormalize, tail, beta),
        coef=coef,
        reduction=reduction,
        max_tokens=max_tokens,
        config=dict(
            beta=beta,
            coef=coef,
            renormalize=renormalize,
            tail=tail,
            reduction=reduction,
            max_tokens=max_tokens,
        ),
    )
