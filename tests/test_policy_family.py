"""The policy family (losses/_policy.py, losses/_policy_seq.py): configs that rebuild their
terms, regressions for peer defects, bad input.

The properties every term shares (NumPy reference, on-policy identity, NaN safety, trust regions,
split_batch, permutation, padding, jit, vmap) run over the case registry (tests/cases.py) in
tests/test_term_properties.py; the mismatch correction is tested in tests/test_correction.py and
the built-in twins in tests/test_twin.py.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses
from tests.cases import MIS_SEQ, POLICY, TIS_TOK, action_weights, fixed_batch, over

# -- 1. configs ---------------------------------------------------------------------------------


@over(POLICY)
def test_config_holds_the_keywords_and_rebuilds_the_term(case):
    kind, kwargs = case.ctor, case.config
    t = case.term()
    cfg = dict(t.config)
    json.dumps(cfg)  # machine-readable: plain values only
    rebuilt = getattr(losses, kind)(**cfg)
    assert rebuilt.config == t.config and rebuilt.kind == t.kind == kind
    # Exactly the constructor's keywords, offset aliases resolved into absolute thresholds.
    params = set(inspect.signature(getattr(losses, kind)).parameters)
    aliases = {"clip_low", "clip_high"} if "clip_low_threshold" in params else set()
    assert set(cfg) == params - aliases
    assert set(kwargs) - aliases <= set(cfg)
    lp, batch = fixed_batch(seed=POLICY.index(case))
    np.testing.assert_array_equal(np.asarray(rebuilt(lp, batch)[0]), np.asarray(t(lp, batch)[0]))


# -- 2. regressions for peer defects (policy-losses.md §10, Fireworks SDK reference §8) ---------


def _one_token_rows(lp, old, adv):
    """Rows of one action token each: ``lp``, ``old`` and ``adv`` are lists of equal length."""
    n = len(lp)
    return jnp.asarray(lp, float).reshape(n, 1), losses.Batch(
        action_mask=jnp.ones((n, 1)),
        advantages=jnp.asarray(adv, float),
        sampling_logprobs=jnp.asarray(old, float).reshape(n, 1),
    )


@pytest.mark.parametrize(
    "term",
    [
        losses.ppo(clip_low_threshold=0.8, clip_high_threshold=1.2, reduction="token_sum"),
        losses.ppo(clip_low=0.2, clip_high=0.2, reduction="token_sum"),
        losses.dapo(clip_low=0.2, clip_high=0.2, reduction="token_sum"),
        losses.dapo(clip_low=0.2, clip_high=0.2, eps_clip_c=3.0, reduction="token_sum"),
        losses.gspo(clip_low=0.2, clip_high=0.2, reduction="token_sum"),
    ],
    ids=["ppo", "ppo-offsets", "dapo", "dapo-dual", "gspo"],
)
def test_negative_advantage_clip_is_not_inverted(term):
    # EasyDeL (§10.1) used max(rA, cA) for A<0. With A=-1, eps=0.2: at r=0.5 the PPO gradient
    # is 0 (clipped: the bad token is already pushed down); at r=2.0 it is -A·r = +2.0.
    lp, batch = _one_token_rows(np.log([0.1, 0.2]), np.log([0.2, 0.1]), [-1.0, -1.0])
    g = jax.grad(lambda x: term(x, batch)[0])(lp)
    np.testing.assert_allclose(np.asarray(g)[:, 0], [0.0, 2.0], rtol=1e-12)
    assert float(g[0, 0]) == 0.0


@pytest.mark.parametrize(
    "term",
    [
        losses.cispo(reduction="token_sum"),
        losses.cispo(clip_low=0.2, clip_high=0.28, reduction="token_sum"),
        losses.reinforce(ratio_weight=True, reduction="token_sum"),
    ],
    ids=["cispo", "cispo-offsets", "reinforce-ratio"],
)
def test_clipped_ratio_coefficient_is_stop_gradient(term):
    # EasyDeL's CISPO (§10.2) let the gradient flow through r: with lp=log 0.3, lp_old=log 0.25,
    # A=1 it gives d/dlp[-r·A·lp] = -r·(1 + lp)·A = +0.245. The coefficient must be detached: -1.2.
    lp, batch = _one_token_rows([math.log(0.3)], [math.log(0.25)], [1.0])
    g = float(jax.grad(lambda x: term(x, batch)[0])(lp)[0, 0])
    assert g == pytest.approx(-1.2, rel=1e-12)
    defective = -1.2 * (1.0 + math.log(0.3))
    assert defective == pytest.approx(0.2447, abs=1e-4) and abs(g - defective) > 1.0


@pytest.mark.parametrize("estimator", losses.KL_ESTIMATORS)
def test_reinforce_kl_penalty_has_a_true_gradient(estimator):
    # The Fireworks cookbook's REINFORCE adds β(sg(π) - ref): zero gradient (SDK reference §8).
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 3)),
        advantages=jnp.zeros((1,)),
        sampling_logprobs=lp,
        ref_logprobs=jnp.array([[-1.5, -1.0, -0.5]]),
    )
    term = losses.reinforce(kl_coef=1.0, kl_estimator=estimator, reduction="token_sum")
    g = np.asarray(jax.grad(lambda x: term(x, batch)[0])(lp))[0]
    delta = np.array([0.5, -1.0, 0.0])
    expected = {"k1": np.ones(3), "k2": delta, "k3": 1 - np.exp(-delta)}[estimator]
    np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-15)
    if estimator != "k1":
        assert g[0] > 0 and g[1] < 0 and g[2] == 0  # descent moves p toward ref


@over(POLICY)
def test_masked_exp_of_a_huge_log_ratio_gives_no_nan(case):
    # §10.3 / §8: sum(-min(rA, cA)·m) with a masked log-ratio of 200 has gradient [-1, nan] when
    # the mask multiplies after exp (0·inf in the backward pass).
    lp = jnp.array([[-1.0, 0.0]])
    batch = losses.Batch(
        action_mask=jnp.array([[1.0, 0.0]]),
        advantages=jnp.array([1.0]),
        old_logprobs=jnp.array([[-1.0, -200.0]]),
        sampling_logprobs=jnp.array([[-1.0, 200.0]]),
        ref_logprobs=jnp.array([[-1.0, -200.0]]),
    )
    (value, metrics), g = jax.value_and_grad(lambda x: case.term()(x, batch), has_aux=True)(lp)
    assert np.isfinite(float(value)) and all(np.isfinite(float(v)) for v in metrics.values())
    w = action_weights(batch, case)
    np.testing.assert_array_equal(np.asarray(g), -1.0 * w)  # on-policy token: -A·w; masked: 0
    assert float(g[0, 1]) == 0.0


def test_gspo_sequence_ratio_ignores_padding_and_masked_tokens():
    # Soup#723 / the Fireworks cookbook's main GSPO average p - q over the whole response slice.
    # Valid log-ratios 0.1 and 0.3 → s = e^0.2, whatever the masked or padded tokens hold.
    lp = jnp.array([[-1.0, -1.0, -1.0, -1.0]])
    old = jnp.array([[-1.1, -1.3, -6.0, -6.0]])  # masked log-ratios 5.0
    mask = jnp.array([[1.0, 1.0, 0.0, 0.0]])
    batch = losses.Batch(action_mask=mask, advantages=jnp.array([1.0]), sampling_logprobs=old)
    term = losses.gspo(clip_low=0.5, clip_high=0.5, reduction="token_sum")
    (value, metrics), g = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(lp)
    s = math.exp(0.2)
    assert float(metrics["seq_ratio_mean"]) == pytest.approx(s, rel=1e-12)
    assert float(value) == pytest.approx(-2 * s, rel=1e-12)
    np.testing.assert_allclose(np.asarray(g), [[-s, -s, 0.0, 0.0]], rtol=1e-12)
    unmasked = math.exp((0.1 + 0.3 + 5.0 + 5.0) / 4)  # the defective ratio
    assert abs(float(value) - (-2 * min(unmasked, 1.5))) > 0.5
    # More padding (columns and a row) changes nothing.
    padded = losses.Batch(
        action_mask=jnp.pad(mask, ((0, 1), (0, 3))),
        advantages=jnp.array([1.0, 7.0]),
        sampling_logprobs=jnp.pad(old, ((0, 1), (0, 3)), constant_values=-50.0),
    )
    v2, m2 = term(jnp.pad(lp, ((0, 1), (0, 3))), padded)
    assert float(v2) == float(value) and float(m2["seq_ratio_mean"]) == float(
        metrics["seq_ratio_mean"]
    )


def test_dro_penalty_applies_where_the_advantage_is_zero():
    # Tinker kernel: the quadratic applies at every position; the Fireworks cookbook client gates
    # it on A ≠ 0 (contradicting its docstring). An A = 0 row must still be pulled to q.
    lp = jnp.array([[-1.0, -2.0]])
    batch = losses.Batch(
        action_mask=jnp.ones((1, 2)),
        advantages=jnp.zeros((1,)),
        sampling_logprobs=jnp.array([[-1.5, -1.0]]),
    )
    g = np.asarray(jax.grad(lambda x: losses.dro(beta=0.4, reduction="token_sum")(x, batch)[0])(lp))
    np.testing.assert_allclose(g, [[0.4 * 0.5, 0.4 * -1.0]], rtol=1e-12)


# -- 3. bad input -------------------------------------------------------------------------------


BAD = [
    (losses.ppo, dict(clip_low=0.1, clip_low_threshold=0.9), "not both"),
    (losses.ppo, dict(clip_low_threshold=1.1), "clip_low_threshold must be <= 1.0"),
    (losses.ppo, dict(clip_high_threshold=0.9), "clip_high_threshold must be >= 1.0"),
    (losses.ppo, dict(clip_low=-0.1), "clip_low must be >= 0.0"),
    (losses.ppo, dict(reduction="mean"), "unknown reduction 'mean'"),
    (losses.ppo, dict(correction="tis"), "correction must be None"),
    (losses.ppo, dict(correction=dict(kind="tis", C=2)), r"unknown correction keys \['C'\]"),
    (losses.importance_sampling, dict(max_log_ratio=0), "max_log_ratio must be > 0.0"),
    (losses.importance_sampling, dict(reduction="seq_mean_token_sum_norm"), "needs max_tokens"),
    (losses.cispo, dict(clip_high=0.2, clip_high_threshold=5.0), "not both"),
    (losses.cispo, dict(clip_high_threshold=0.5), "clip_high_threshold must be >= 1.0"),
    (losses.dro, dict(beta=-1.0), "beta must be >= 0.0"),
    (losses.dro, dict(beta=float("inf")), "beta must be finite"),
    (losses.dapo, dict(eps_clip_c=1.0), "eps_clip_c must be > 1.0"),
    (losses.dapo, dict(eps_clip_c="3"), "eps_clip_c must be a number"),
    (losses.dapo, dict(clip_high=-0.1), "clip_high must be >= 0.0"),
    (losses.dapo, dict(clip_low=0.2, clip_high_threshold=1.3), "not both"),
    (losses.gspo, dict(seq_ratio_log_cap=0.0), "seq_ratio_log_cap must be > 0.0"),
    (losses.gspo, dict(clip_low=1.5), "clip_low must be <= 1.0"),
    (losses.gspo, dict(clip_low_threshold=-0.1), "clip_low_threshold must be >= 0.0"),
    (losses.gspo, dict(max_tokens=-1), "max_tokens must be > 0"),
    (losses.dppo, dict(divergence="tv"), "unknown divergence 'tv'"),
    (losses.dppo, dict(threshold=0.0), "threshold must be > 0.0"),
    (losses.dppo, dict(threshold=1.5), "threshold must be <= 1.0"),
    (losses.dppo, dict(threshold=float("nan")), "threshold must be finite"),
    (losses.reinforce, dict(ratio_cap=2.0), "ratio_cap needs ratio_weight=True"),
    (losses.reinforce, dict(ratio_weight=True, ratio_cap=0.0), "ratio_cap must be > 0.0"),
    (losses.reinforce, dict(ratio_weight=1), "ratio_weight must be a bool"),
    (losses.reinforce, dict(kl_coef=-0.1), "kl_coef must be >= 0.0"),
    (losses.reinforce, dict(kl_estimator="k4"), "unknown kl_estimator 'k4'"),
    (losses.gmpo, dict(clip_low=-0.1), "clip_low must be >= 0.0"),
    (losses.gmpo, dict(clip_high="wide"), "clip_high must be a number"),
    (losses.sapo, dict(tau_pos=0.0), "tau_pos must be > 0.0"),
    (losses.sapo, dict(tau_neg=-1.0), "tau_neg must be > 0.0"),
    (losses.grpo, dict(correction=3), "correction must be None"),
]


@pytest.mark.parametrize(
    "ctor, kwargs, message", BAD, ids=[f"{c.__name__}-{m[:24]}" for c, _, m in BAD]
)
def test_constructors_reject_bad_hyperparameters(ctor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctor(**kwargs)


def test_missing_batch_fields_are_named():
    lp = jnp.zeros((1, 2))
    mask = jnp.ones((1, 2))
    no_sampling = losses.Batch(action_mask=mask, advantages=jnp.ones(1), old_logprobs=lp)
    with pytest.raises(ValueError, match="needs batch field 'sampling_logprobs'"):
        losses.ppo(correction=TIS_TOK)(lp, no_sampling)
    with pytest.raises(ValueError, match="needs batch field 'sampling_logprobs'"):
        losses.grpo(correction=MIS_SEQ)(lp, no_sampling)
    with pytest.raises(ValueError, match="reinforce needs batch field 'ref_logprobs'"):
        losses.reinforce(kl_coef=0.1)(lp, no_sampling)
    with pytest.raises(ValueError, match="gspo needs batch field 'old_logprobs'"):
        losses.gspo()(lp, losses.Batch(action_mask=mask, advantages=jnp.ones(1)))
    with pytest.raises(ValueError, match="dppo needs batch field 'advantages'"):
        losses.dppo()(lp, losses.Batch(action_mask=mask, sampling_logprobs=lp))


# -- 4. docstring examples ---------------------------------------------------------------------


def test_docstring_examples_run():
    for mod in ("_policy", "_policy_seq"):
        result = doctest.testmod(importlib.import_module(f"losses.{mod}"))
        assert result.failed == 0, mod
