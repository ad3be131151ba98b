"""The one registry of term cases, and the cached jitted value-and-gradient of a term.

`CASES` lists every term configuration the generic properties (tests/test_term_properties.py)
run over: the policy family (each term, each reduction, each kind and level of mismatch
correction), GRPO, the ECHO env term, SFT cross-entropy, weighted cross-entropy and a fold. A
`Case` carries what the properties need to know besides the constructor and its keywords: the
independent NumPy reference, which positions the term reads (the others must be NaN-safe), and
flags derived from its keywords (KL penalty, trust region).

`value_and_grad` compiles one function per (term, shape, pytree structure) and checks, on every
call, that no gradient reaches a batch field and that the metrics are stop-gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings

import losses
from tests import numpy_ref
from tests import numpy_ref_policy as ref_policy

#: One batch shape for the per-case properties (B=4 splits into micro-batches of at most 2 rows),
#: so each case compiles for (4, 6) and for the (2, 6) micro-batches.
B, T = 4, 6
SHAPE = [(B, T)]
#: Examples per case of the per-case properties: a quarter of the profile's (6 of 25 by default,
#: 50 of 200 with ``HYPOTHESIS_PROFILE=thorough``), so ~250 examples per property over the 42
#: cases.
per_case = settings(max_examples=max(4, settings.default.max_examples // 4))

TIS_TOK = losses.mismatch_correction(kind="tis", level="token", cap=1.5)
TIS_SEQ = losses.mismatch_correction(kind="tis", level="sequence", cap=2.5)
MIS_TOK = losses.mismatch_correction(kind="mis", level="token", low=0.6, high=1.7)
MIS_SEQ = losses.mismatch_correction(kind="mis", level="sequence", high=3.0)
ICEPOP = losses.mismatch_correction(kind="icepop", low=0.55, high=2.3)
OPSM = losses.mismatch_correction(kind="opsm", delta=0.04)
#: verl-style IS + rejection chain: sequence TIS, seq_sum k1 bounds, token k3 upper bound.
RS_CHAIN = losses.correction_chain(
    losses.mismatch_correction(kind="tis", level="sequence", cap=2.5),
    losses.mismatch_correction(
        kind="rejection", level="seq_sum", statistic="k1", low=0.3, high=2.6
    ),
    losses.mismatch_correction(kind="rejection", level="token", statistic="k3", high=0.35),
)
#: Masks only: seq_mean k1 (geometric), seq_max k2, and OPSM on the old logprobs.
RS_SEQ = losses.correction_chain(
    losses.mismatch_correction(
        kind="rejection", level="seq_mean", statistic="k1", low=0.7, high=1.45
    ),
    losses.mismatch_correction(kind="rejection", level="seq_max", statistic="k2", high=0.45),
    losses.mismatch_correction(kind="opsm", delta=0.1, behaviour="old"),
)

#: The policy family: (constructor name, keywords). Odd-looking bounds keep ties with the data away.
POLICY_CONFIGS = [
    ("importance_sampling", {}),
    ("importance_sampling", dict(reduction="token_sum", correction=TIS_TOK)),
    ("ppo", {}),
    (
        "ppo",
        dict(clip_low=0.13, clip_high=0.31, reduction="seq_mean_token_mean", correction=MIS_SEQ),
    ),
    ("cispo", {}),
    (
        "cispo",
        dict(clip_low=0.2, clip_high=0.28, reduction="seq_mean_token_sum", correction=MIS_TOK),
    ),
    ("dro", {}),
    ("dro", dict(beta=0.3, reduction="token_sum", correction=TIS_SEQ)),
    ("dapo", {}),
    ("dapo", dict(eps_clip_c=1.7, reduction="seq_mean_token_sum_norm", max_tokens=16)),
    (
        "dapo",
        dict(clip_low_threshold=0.75, clip_high_threshold=1.33, eps_clip_c=2.9, correction=TIS_SEQ),
    ),
    ("gspo", {}),
    ("gspo", dict(clip_low=0.11, clip_high=0.17, reduction="token_sum")),
    (
        "gspo",
        dict(
            clip_low=0.23,
            clip_high=0.19,
            seq_ratio_log_cap=0.07,
            reduction="token_mean",
            correction=MIS_TOK,
        ),
    ),
    ("dppo", {}),
    ("dppo", dict(divergence="binary_kl", reduction="token_sum")),
    (
        "dppo",
        dict(threshold=0.043, reduction="seq_mean_token_mean", correction=TIS_TOK),
    ),
    ("reinforce", {}),
    (
        "reinforce",
        dict(
            ratio_weight=True,
            ratio_cap=1.7,
            kl_coef=0.1,
            kl_estimator="k2",
            reduction="seq_mean_token_sum",
            correction=MIS_SEQ,
        ),
    ),
    ("reinforce", dict(ratio_weight=True, kl_coef=0.05, kl_estimator="k3", reduction="token_sum")),
    ("gmpo", {}),
    ("gmpo", dict(clip_low=0.13, clip_high=0.21, reduction="token_sum", correction=TIS_TOK)),
    ("sapo", {}),
    ("sapo", dict(tau_pos=0.7, tau_neg=2.3, reduction="token_mean", correction=MIS_SEQ)),
    ("grpo", dict(correction=TIS_TOK)),
    (
        "grpo",
        dict(
            kl_coef=0.1,
            dual_clip=2.2,
            clip_high=0.28,
            reduction="seq_mean_token_mean",
            correction=MIS_SEQ,
        ),
    ),
    ("importance_sampling", dict(reduction="seq_mean_token_mean", correction=ICEPOP)),
    ("ppo", dict(reduction="token_sum", correction=OPSM)),
    ("grpo", dict(clip_high=0.28, correction=RS_CHAIN)),
    ("cispo", dict(reduction="seq_mean_token_sum", correction=RS_SEQ)),
]
# -- docs/sources.md#kl-variants (task policy2): KL variants, newer objectives ----------------------
#: Generic properties that cannot hold (or that the generic oracle does not model) for a case,
#: as ``(test function name, reason)`` pairs; `over` marks them skipped with the reason.
_REF = "test_matches_numpy_reference"
_ON_POLICY = "test_on_policy_gradient_is_minus_advantage_times_weight"
_TRUST = "test_zero_gradient_exactly_where_the_trust_region_says"
_SPLIT = "test_split_batch_reproduces_full_batch"
_PERM = "test_row_permutation_invariance"
_PAD = "test_padding_rows_and_columns_change_nothing"
_MICRO = "covariance statistics are per call (verl): split_batch is not exact (module docstring)"
_ORACLE = "expected_zero does not model this term; test_policy_family.py checks its zero set"
_PHI = "VESPO's φ underflows to exactly 0 for large sequence weights (a soft trust region)"
COV_SKIPS = (
    (_ON_POLICY, "Clip-Cov detaches covariance candidates even on-policy"),
    (_TRUST, "Clip-Cov zeroes a covariance subset: test_policy_family.py checks its zero set"),
    (_SPLIT, _MICRO),
)
RANDOM_SKIPS = COV_SKIPS + (
    (_REF, "a random subset: test_policy_family.py checks membership and the value given it"),
    (_PAD, "compared with the NumPy reference, which cannot draw JAX's subset"),
    (_PERM, "the subset is keyed by (row, column)"),
)
TOPK_SKIPS = (
    (_REF, "top-k near ties round differently in NumPy (test_policy_family.py: tie-free data)"),
    (_PAD, "compared with the NumPy reference (near ties)"),
    (_PERM, "ties at the top-k boundary are broken by position"),
    (_SPLIT, _MICRO),
)
POLICY_CONFIGS += [
    # KL variants on grpo / reinforce (has_kl: no trust-region property).
    ("grpo", dict(delta=1.9, kl_coef=0.07, kl_importance_weight=True)),
    (
        "grpo",
        dict(kl_coef=0.1, kl_estimator="k1", kl_importance_weight=True, reduction="token_sum"),
    ),
    ("grpo", dict(kl_coef=0.2, kl_estimator="k3", kl_score_function=True, correction=TIS_TOK)),
    (
        "reinforce",
        dict(
            ratio_weight=True,
            kl_coef=0.3,
            kl_estimator="k2",
            kl_score_function=True,
            kl_importance_weight=True,
            reduction="seq_mean_token_sum",
        ),
    ),
    # Two-sided delta and LUSPO (the trust-region oracle knows neither).
    ("grpo", dict(delta=1.45, clip_high=0.28), ((_TRUST, _ORACLE),)),
    (
        "gspo",
        dict(clip_low=0.2, clip_high=0.25, delta=1.6, reduction="token_sum"),
        ((_TRUST, _ORACLE),),
    ),
    ("luspo", {}, ((_TRUST, _ORACLE),)),
    (
        "luspo",
        dict(clip_low=0.15, clip_high=0.2, delta=2.1, correction=TIS_TOK),
        ((_TRUST, _ORACLE),),
    ),
    # Clip-Cov: every candidate zeroed (deterministic), then the random subset.
    (
        "clip_cov",
        dict(
            clip_cov_ratio=1.0, clip_cov_lb=0.6173, clip_cov_ub=4.391, clip_low=0.15, clip_high=0.25
        ),
        COV_SKIPS,
    ),
    ("clip_cov", dict(seed=7, reduction="seq_mean_token_mean", correction=MIS_TOK), RANDOM_SKIPS),
    # KL-Cov: every token penalised (micro-batch exact), then the top-1 token.
    ("kl_cov", dict(kl_cov_ratio=1.0, ppo_kl_coef=0.3, correction=TIS_SEQ)),
    ("kl_cov", dict(reduction="token_sum"), TOPK_SKIPS),
    # VESPO: φ underflows to exactly 0 for large sequence weights (a soft trust region).
    ("vespo", {}, ((_TRUST, _PHI),)),
    (
        "vespo",
        dict(k_pos=1.5, lambda_pos=2.5, k_neg=2.5, lambda_neg=1.5, correction=MIS_TOK),
        ((_TRUST, _PHI),),
    ),
    ("dppo_tv_kl", {}),
    (
        "dppo_tv_kl",
        dict(mask_low=0.05, mask_high=0.1, kl_tau=0.05, reduction="seq_mean_token_mean"),
    ),
]
#: `losses.kl_loss` (group ``"kl"``: not ratio-based).
KL_CONFIGS = [
    dict(estimator="k3", importance_weight=True),
    dict(estimator="k1", score_function=True, reduction="seq_mean_token_mean"),
    dict(
        estimator="k2", score_function=True, importance_weight=True, coef=0.3, reduction="token_sum"
    ),
    dict(estimator="sq_log_ratio", target="sampling_logprobs", coef=0.5),
    dict(estimator="rllm_bwd", target="sampling_logprobs", reduction="seq_mean_token_sum"),
    dict(estimator="rllm_bwd_sf", target="sampling_logprobs", coef=0.2),
    # An odd clamp (exercised by the data), so that no drawn log-ratio sits on its boundary.
    dict(
        estimator="rllm_fwd",
        target="sampling_logprobs",
        reduction="token_sum",
        max_log_ratio=1.3717,
    ),
]
GRPO_CONFIGS = [
    dict(),
    dict(clip_low=0.2, clip_high=0.28, reduction="seq_mean_token_mean"),
    dict(dual_clip=3.0, reduction="seq_mean_token_sum"),
    dict(kl_coef=0.1, kl_estimator="k1", reduction="token_sum"),
    dict(kl_coef=0.05, kl_estimator="k2", reduction="seq_mean_token_sum_norm", max_tokens=16),
    dict(kl_coef=0.2, kl_estimator="k3", dual_clip=1.5, clip_low=0.1, clip_high=0.3),
]
ENV_CONFIGS = [
    dict(),
    dict(coef=1.0, normalization="token_mean"),
    dict(coef=0.3, normalization="token_sum"),
]
SFT_CONFIGS = [
    dict(reduction=r, max_tokens=8 if r == "seq_mean_token_sum_norm" else None)
    for r in losses.REDUCTIONS
]
#: The fold case: grpo with these keywords plus ``echo_env(coef=FOLD_ENV_COEF)``.
FOLD_CONFIG = dict(kl_coef=0.1, reduction="seq_mean_token_mean")
FOLD_ENV_COEF = 0.3


def _fold(**cfg) -> losses.Term:
    return losses.fold(losses.grpo(**cfg), losses.echo_env(coef=FOLD_ENV_COEF))


#: Constructors by name (anything else is ``getattr(losses, name)``).
_CTORS: dict[str, Callable[..., Any]] = {
    "sft": losses.sft_cross_entropy,
    "wce": losses.weighted_cross_entropy,
    "fold": _fold,
}


def freeze(kwargs: dict) -> tuple:
    return tuple(sorted(kwargs.items()))


@functools.cache
def term(ctor: str, frozen_kwargs: tuple = ()) -> losses.Term:
    """The term ``ctor(**kwargs)``, built once per (constructor, keywords)."""
    return _CTORS.get(ctor, getattr(losses, ctor, None))(**dict(frozen_kwargs))


# -- NumPy references and metric checks ---------------------------------------------------------


def _echo_metrics(metrics, lp, batch):
    obs = np.asarray(batch.obs_mask) > 0
    assert metrics["num_obs_tokens"] == obs.sum()
    assert metrics["rows_with_obs"] == obs.any(axis=1).sum()
    if obs.any():
        assert metrics["nll"] == pytest.approx(-lp[obs].mean())


def _sft_metrics(metrics, lp, batch):
    assert metrics["num_tokens"] == np.asarray(batch.action_mask).sum()


def _fold_ref(lp, batch, **cfg):
    ref_p = numpy_ref.grpo_ref(lp, batch, **cfg)
    ref_e = numpy_ref.echo_env_ref(lp, batch, coef=FOLD_ENV_COEF)
    return ref_p[0] + ref_e[0], ref_p[1] + ref_e[1]


# -- the registry -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """A term configuration and what the generic properties need to know about it.

    Attributes:
      id: the pytest id.
      group: where the case comes from: ``"policy"`` (the policy family), ``"grpo"``,
        ``"echo_env"``, ``"sft"``, ``"wce"`` or ``"fold"``.
      ctor: the constructor's name (``losses.<ctor>``, or ``sft`` / ``wce`` / ``fold``).
      kwargs: the constructor's keywords, as sorted ``(name, value)`` pairs.
      reference: ``(lp, batch) -> (value, grad)``, the independent NumPy reference; None for
        an ad-hoc `spec`.
      reads: the positions whose logprobs and anchors can matter: ``"action"``, ``"obs"``,
        ``"action+obs"`` or ``"weights"`` (non-zero weights); every other position is NaN-safe.
      exact_grad: the reference gradient is compared with ``==`` (else to 1e-10 relative).
      check_metrics: ``(metrics, lp, batch)``, asserts the term's own metrics.
      skip: ``(property test name, reason)`` pairs: generic properties that cannot hold for the
        case; `over` marks them skipped with the reason.
    """

    id: str
    group: str
    ctor: str
    kwargs: tuple = ()
    reference: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
    reads: str = "action"
    exact_grad: bool = False
    check_metrics: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
    skip: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def config(self) -> dict:
        """The constructor's keywords."""
        return dict(self.kwargs)

    def term(self) -> losses.Term:
        return term(self.ctor, self.kwargs)

    @property
    def ratio_based(self) -> bool:
        """A policy-gradient term on importance ratios (the policy family and GRPO)."""
        return self.group in ("policy", "grpo")

    @property
    def has_kl(self) -> bool:
        return bool(self.config.get("kl_coef"))

    @property
    def trust_region(self) -> bool:
        """Ratio-based without a KL penalty: the gradient is exactly zero where the trust region
        (or an MIS rejection) says, and non-zero elsewhere (`test_zero_gradient_...`)."""
        return self.ratio_based and not self.has_kl

    @property
    def padding_vs_jit(self) -> bool:
        """The padding property also compares with the jitted unpadded batch (to 1e-12), not only
        with the NumPy reference (to 1e-10): the non-policy cases, which were checked that way
        before the registry. It costs one more compilation per case (the unpadded shape)."""
        return self.group != "policy"

    def read_mask(self, batch) -> np.ndarray:
        """bool[B, T]: the positions the term reads."""
        action = np.asarray(batch.action_mask) > 0
        if self.reads == "action":
            return action
        obs = np.asarray(batch.obs_mask) > 0
        if self.reads == "obs":
            return obs
        if self.reads == "action+obs":
            return action | obs
        assert self.reads == "weights", self.reads
        return np.asarray(batch.weights) != 0


def spec(ctor: str, **kwargs) -> Case:
    """An ad-hoc case (no reference) for `value_and_grad`: ``spec("echo_env", coef=0.2)``."""
    return Case(id=f"{ctor}{kwargs}", group="spec", ctor=ctor, kwargs=freeze(kwargs))


def _policy(i, ctor, kwargs, skip=()):
    return Case(
        id=f"p{i:02d}-{ctor}",
        group="policy",
        ctor=ctor,
        kwargs=freeze(kwargs),
        reference=functools.partial(ref_policy.policy_ref, ctor, **kwargs),
        skip=skip,
    )


CASES: list[Case] = (
    [_policy(i, *entry) for i, entry in enumerate(POLICY_CONFIGS)]
    + [
        Case(
            id=f"grpo{i}",
            group="grpo",
            ctor="grpo",
            kwargs=freeze(cfg),
            reference=functools.partial(numpy_ref.grpo_ref, **cfg),
        )
        for i, cfg in enumerate(GRPO_CONFIGS)
    ]
    + [
        Case(
            id=f"echo_env{i}",
            group="echo_env",
            ctor="echo_env",
            kwargs=freeze(cfg),
            reference=functools.partial(numpy_ref.echo_env_ref, **cfg),
            reads="obs",
            check_metrics=_echo_metrics,
        )
        for i, cfg in enumerate(ENV_CONFIGS)
    ]
    + [
        Case(
            id=f"sft-{cfg['reduction']}",
            group="sft",
            ctor="sft",
            kwargs=freeze(cfg),
            reference=functools.partial(numpy_ref.sft_ref, **cfg),
            check_metrics=_sft_metrics,
        )
        for cfg in SFT_CONFIGS
    ]
    + [
        Case(
            id="wce",
            group="wce",
            ctor="wce",
            reference=numpy_ref.weighted_ce_ref,
            reads="weights",
            exact_grad=True,
        ),
        Case(
            id="fold",
            group="fold",
            ctor="fold",
            kwargs=freeze(FOLD_CONFIG),
            reference=functools.partial(_fold_ref, **FOLD_CONFIG),
            reads="action+obs",
        ),
    ]
    + [
        Case(
            id=f"kl{i}-{cfg['estimator']}",
            group="kl",
            ctor="kl_loss",
            kwargs=freeze(cfg),
            reference=functools.partial(ref_policy.kl_loss_ref, **cfg),
        )
        for i, cfg in enumerate(KL_CONFIGS)
    ]
)
assert len({c.id for c in CASES}) == len(CASES)
POLICY = [c for c in CASES if c.group == "policy"]
GRPO = [c for c in CASES if c.group == "grpo"]


def ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


def over(cases: list[Case]):
    """``@pytest.mark.parametrize("case", cases)`` with the case ids; a case whose `Case.skip`
    names the decorated test is marked skipped with the reason."""

    def decorate(fn):
        params = [
            pytest.param(
                c,
                id=c.id,
                marks=[pytest.mark.skip(reason=r) for name, r in c.skip if name == fn.__name__],
            )
            for c in cases
        ]
        return pytest.mark.parametrize("case", params)(fn)

    return decorate


# -- the cached jitted value and gradient -------------------------------------------------------


@functools.cache
def _jitted(ctor: str, frozen_kwargs: tuple):
    t = term(ctor, frozen_kwargs)

    def f(lp, batch):
        (value, metrics), (g_lp, g_batch) = jax.value_and_grad(
            lambda x, b: t(x, b), argnums=(0, 1), has_aux=True
        )(lp, batch)
        g_metrics = jax.grad(lambda x: sum(t(x, batch)[1].values()))(lp)
        return value, metrics, g_lp, g_batch, g_metrics

    return jax.jit(f)


def value_and_grad(case: Case, lp, batch):
    """((value, metrics), grad) of the case's term as numpy (one jit per term, cached).

    Every call also checks that the gradient with respect to every batch field is exactly 0 and
    that the metrics are stop-gradient (the gradient of their sum is exactly 0).
    """
    out = _jitted(case.ctor, case.kwargs)(jnp.asarray(lp), batch)
    value, metrics, g_lp, g_batch, g_metrics = jax.device_get(out)  # one transfer
    for name, g in g_batch.fields.items():
        assert g is None or not np.any(g), f"gradient reaches batch field {name}"
    assert not np.any(g_metrics), "a metric is not stop-gradient"
    return (float(value), {k: float(v) for k, v in metrics.items()}), np.asarray(g_lp)


# -- small shared helpers -----------------------------------------------------------------------


def adv_BT(batch) -> np.ndarray:
    """The advantages broadcast to ``[B, T]``."""
    a = np.asarray(batch.advantages)
    return np.broadcast_to(a[:, None], batch.shape) if a.ndim == 1 else a


def action_weights(batch, case: Case) -> np.ndarray:
    """The reduction weights of the case's term over the action mask."""
    cfg = case.term().config
    return np.asarray(losses.term_weights(batch, "action", cfg["reduction"], cfg["max_tokens"]))


def fixed_batch(seed=0, b=B, t=T):
    """A deterministic batch with the same fields (pytree structure) as `policy_batches`."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.01, 4.0, (b, t))
    old = np.minimum(lp + rng.uniform(-1, 1, (b, t)), 0)
    action = rng.uniform(size=(b, t)) < 0.7
    batch = losses.Batch(
        action_mask=action.astype(float),
        obs_mask=(~action).astype(float),
        advantages=rng.normal(size=b),
        sampling_logprobs=np.minimum(old + rng.uniform(-1, 1, (b, t)), 0),
        old_logprobs=old,
        ref_logprobs=np.minimum(lp + rng.uniform(-1, 1, (b, t)), 0),
        weights=rng.normal(size=(b, t)),
    )
    return lp, batch
