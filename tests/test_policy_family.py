"""The policy family (losses/_policy.py, _policy_seq.py, _dppo.py, _covariance.py, _kl.py): configs
that rebuild their terms, regressions for peer defects, bad input, and the newer objectives of
docs/sources.md#newer-objectives (Clip-Cov, KL-Cov, VESPO, LUSPO, two-sided delta, GSPO-token,
prime-rl DPPO-Binary-TV + KL) with their worked examples and what holds of them where a generic
property cannot (random subsets, micro-batch statistics).

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
from tests import numpy_ref_policy as ref
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


# -- 2. regressions for peer defects (docs/sources.md#defects-in-peer-implementations, docs/training-api.md#known-pitfalls) ---------


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
    # The Fireworks cookbook's REINFORCE adds β(sg(π) - ref): zero gradient (docs/training-api.md#known-pitfalls).
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
    cfg = case.term().config
    # On-policy token: -A·w (+ β·w for the exact k1 KL, whose gradient is 1); masked: 0.
    k1 = cfg.get("kl_coef") and cfg["kl_estimator"] == "k1" and not cfg["kl_score_function"]
    expected = -1.0 * w + (cfg["kl_coef"] * w if k1 else 0.0)
    np.testing.assert_array_equal(np.asarray(g), expected)
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
    for mod in ("_policy", "_policy_seq", "_dppo", "_covariance", "_kl"):
        result = doctest.testmod(importlib.import_module(f"losses.{mod}"))
        assert result.failed == 0, mod


# -- 5. newer objectives (docs/sources.md#newer-objectives) --------------------------------------------------


def _vg(term, lp, batch):
    """(value, metrics, grad) of a term, eagerly."""
    (value, metrics), grad = jax.value_and_grad(lambda x: term(x, batch), has_aux=True)(
        jnp.asarray(lp, float)
    )
    return float(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def _random_batch(seed, b=4, t=6, spread=0.15, per_token_adv=True, p_mask=0.8):
    """Continuous random data (no ties, no zero advantages)."""
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.1, 3.0, (b, t))
    mask = rng.uniform(size=(b, t)) < p_mask
    mask[:, 0] = True
    adv = rng.normal(size=(b, t) if per_token_adv else b)
    batch = losses.Batch(
        action_mask=mask.astype(float),
        advantages=adv,
        sampling_logprobs=lp + rng.normal(0, spread, (b, t)),
    )
    return lp, batch


COV_EXAMPLE_LP = np.array([[-0.5, -3.0, -1.0, -3.0]])
COV_EXAMPLE_ADV = np.array([[2.0, 2.0, -2.0, -2.0]])


def test_covariance_worked_example():
    # §3.1: cov = [2.75, -2.25, -1.75, 2.25].
    batch = losses.Batch(
        action_mask=np.ones((1, 4)), advantages=COV_EXAMPLE_ADV, sampling_logprobs=COV_EXAMPLE_LP
    )
    cov = ref.covariance_ref(COV_EXAMPLE_LP, batch)
    np.testing.assert_allclose([cov[(0, j)] for j in range(4)], [2.75, -2.25, -1.75, 2.25])
    _, metrics, _ = _vg(losses.kl_cov(), COV_EXAMPLE_LP, batch)
    assert metrics["cov_mean"] == pytest.approx(0.25)


def test_clip_cov_worked_example_zeroes_one_of_the_two_candidates_uniformly():
    # §3.1: candidates {0, 3} (1 < cov < 5, r = 1); N = 4 → one is zeroed at random. Assert
    # membership, and that both come up over 200 keys (data: extra["rng"] = 0..199, vmapped).
    n = 200
    one = losses.Batch(
        action_mask=np.ones((1, 4)), advantages=COV_EXAMPLE_ADV, sampling_logprobs=COV_EXAMPLE_LP
    )
    term = losses.clip_cov(reduction="token_sum")
    lp = jnp.asarray(COV_EXAMPLE_LP)

    def draw(rng):
        return jax.value_and_grad(lambda x: term(x, one.replace(extra={"rng": rng}))[0])(lp)

    values, grads = jax.vmap(draw)(jnp.arange(n, dtype=float))
    grads = np.asarray(grads)[:, 0]
    zero0, zero3 = grads[:, 0] == 0, grads[:, 3] == 0
    assert np.all(zero0 ^ zero3)  # exactly one candidate per draw
    np.testing.assert_array_equal(grads[:, 1:3], np.broadcast_to([-2.0, 2.0], (n, 2)))
    np.testing.assert_allclose(np.asarray(values), np.where(zero0, 2.0, -2.0))
    assert 70 <= zero0.sum() <= 130  # uniform: 100 ± 4.2σ
    # Without extra["rng"] the key is key(seed): deterministic.
    g1 = _vg(term, COV_EXAMPLE_LP, one)[2]
    g2 = _vg(losses.clip_cov(reduction="token_sum", seed=0), COV_EXAMPLE_LP, one)[2]
    np.testing.assert_array_equal(g1, g2)


CLIP_COV_RANDOM = dict(clip_cov_ratio=0.25, clip_cov_lb=-0.3, clip_cov_ub=0.3, clip_low=0.1)


@pytest.mark.parametrize("seed", range(6))
def test_clip_cov_zeroes_a_valid_random_subset(seed):
    # The zeroed cells (where the gradient vanishes though PPO's would not) are a subset of the
    # candidates of size min(k, |C|), and value and gradient are the reference's given them.
    lp, batch = _random_batch(seed, spread=0.08)
    term = losses.clip_cov(reduction="seq_mean_token_mean", **CLIP_COV_RANDOM)
    cfg = dict(reduction="seq_mean_token_mean", **CLIP_COV_RANDOM)
    cand, k = ref.clip_cov_candidates(lp, batch, **cfg)
    assert len(cand) > k  # a genuine random choice
    picks = set()
    for rng in range(3):
        b = batch.replace(extra={"rng": float(rng)})
        value, metrics, grad = _vg(term, lp, b)
        zeroed = {c for c in cand if grad[c] == 0.0}
        v_ref, g_ref = ref.new_policy_ref("clip_cov", lp, b, zeroed=zeroed, **cfg)
        np.testing.assert_allclose(value, v_ref, rtol=1e-10)
        np.testing.assert_allclose(grad, g_ref, rtol=1e-10, atol=1e-13)
        n_valid = np.asarray(batch.action_mask).sum()
        assert metrics["cov_zeroed_frac"] == pytest.approx(min(k, len(cand)) / n_valid)
        assert metrics["cov_candidate_frac"] == pytest.approx(len(cand) / n_valid)
        picks.add(frozenset(zeroed))
    assert len(picks) > 1  # the data key draws new subsets


def test_clip_cov_subset_is_padding_invariant():
    lp, batch = _random_batch(1, spread=0.08)
    term = losses.clip_cov(**CLIP_COV_RANDOM)
    b = batch.replace(extra={"rng": 5.0})
    v, _, g = _vg(term, lp, b)

    def pad(x, value):
        x = np.asarray(x)
        x = np.pad(x, ((0, 0), (0, 3)), constant_values=value) if x.ndim == 2 else x
        return np.concatenate([x, np.full((2, *x.shape[1:]), value)])

    padded = losses.Batch(
        action_mask=pad(b.action_mask, 0.0),
        advantages=pad(b.advantages, np.nan),
        sampling_logprobs=pad(b.sampling_logprobs, np.nan),
        extra={"rng": 5.0},
    )
    v2, _, g2 = _vg(term, pad(lp, -np.inf), padded)
    assert v2 == pytest.approx(v, rel=1e-12)
    np.testing.assert_allclose(g2[:4, :6], g, rtol=1e-12, atol=1e-15)
    assert np.all(g2[4:] == 0) and np.all(g2[:, 6:] == 0)


def test_clip_cov_rng_must_be_a_small_nonnegative_integer():
    lp, batch = _random_batch(2)
    term = losses.clip_cov()
    losses.check_batch(batch.replace(extra={"rng": 3.0}), lp, term=term)
    for bad in (-1.0, 2.5, 2.0**24):
        with pytest.raises(ValueError, match="extra field 'rng' must be a 0-d integer"):
            losses.check_batch(batch.replace(extra={"rng": bad}), lp, term=term)
    with pytest.raises(ValueError, match="'rng' must be 0-d"):
        term(lp, batch.replace(extra={"rng": np.arange(4.0)}))


def test_kl_cov_worked_example():
    # §3.1: top-1 is token 0; with old_0 = -0.6: ℓ_0 = -2e^0.1 + 0.1·0.1 = -2.20034 and
    # ∂ℓ_0/∂p_0 = -2.11034 (κ = 0.1, the verl YAML default).
    old = COV_EXAMPLE_LP.copy()
    old[0, 0] = -0.6
    batch = losses.Batch(
        action_mask=np.ones((1, 4)), advantages=COV_EXAMPLE_ADV, sampling_logprobs=old
    )
    value, metrics, grad = _vg(losses.kl_cov(reduction="token_sum"), COV_EXAMPLE_LP, batch)
    np.testing.assert_allclose(value - (-2.0 + 2.0 + 2.0), -2.20034, atol=6e-6)
    np.testing.assert_allclose(grad[0], [-2.11034, -2.0, 2.0, 2.0], atol=6e-6)
    assert metrics["kl_cov_frac"] == 0.25


def test_kl_cov_ties_go_to_the_lower_row_major_index():
    # All four covariances equal 0.5: the top-1 is row 0, column 0 (torch.topk: undefined).
    lp = np.array([[-1.0, -2.0], [-1.0, -2.0]])
    batch = losses.Batch(
        action_mask=np.ones((2, 2)),
        advantages=np.array([[1.0, -1.0], [1.0, -1.0]]),
        sampling_logprobs=lp - 0.1,
    )
    cov = ref.covariance_ref(lp, batch)
    assert len(set(cov.values())) == 1
    _, _, grad = _vg(losses.kl_cov(kl_cov_ratio=0.25, reduction="token_sum"), lp, batch)
    r = math.exp(0.1)
    np.testing.assert_allclose(grad, [[-r + 0.1, r], [-r, r]], rtol=1e-12)


@pytest.mark.parametrize("seed, ratio", [(s, r) for s in range(4) for r in (2e-4, 0.2, 0.5)])
def test_kl_cov_top_k_matches_the_reference_on_tie_free_data(seed, ratio):
    lp, batch = _random_batch(seed, spread=0.3, per_token_adv=seed % 2 == 0)
    cov = sorted(ref.covariance_ref(lp, batch).values(), reverse=True)
    k = max(int(ratio * len(cov)), 1)
    assert k == len(cov) or cov[k - 1] - cov[k] > 1e-9  # a clear top-k boundary
    cfg = dict(kl_cov_ratio=ratio, ppo_kl_coef=0.7, reduction="seq_mean_token_sum")
    value, metrics, grad = _vg(losses.kl_cov(**cfg), lp, batch)
    v_ref, g_ref = ref.new_policy_ref("kl_cov", lp, batch, **cfg)
    np.testing.assert_allclose(value, v_ref, rtol=1e-10)
    np.testing.assert_allclose(grad, g_ref, rtol=1e-10, atol=1e-13)
    assert metrics["kl_cov_frac"] == pytest.approx(k / len(cov))


def test_covariance_terms_are_per_micro_batch():
    # verl computes the covariance per call: each micro-batch of split_batch is the term on that
    # micro-batch alone, rescaled to the full batch's carried normalizer (token_mean: N_k / N).
    lp, batch = _random_batch(3, spread=0.3)
    n_full = float(np.asarray(batch.action_mask).sum())
    parts = losses.split_batch(batch, 2)
    slices = losses.row_slices(4, 2)
    for term, kind, cfg in (
        (losses.kl_cov(kl_cov_ratio=0.2), "kl_cov", dict(kl_cov_ratio=0.2)),
        (losses.clip_cov(clip_cov_ratio=1.0), "clip_cov", dict(clip_cov_ratio=1.0)),
    ):
        total = 0.0
        for sl, part in zip(slices, parts, strict=True):
            v, _, g = _vg(term, lp[sl], part)
            alone = part.replace(num_rows=None, num_action_tokens=None, num_obs_tokens=None)
            v_ref, g_ref = ref.new_policy_ref(kind, lp[sl], alone, **cfg)
            n_k = float(np.asarray(part.action_mask).sum())
            np.testing.assert_allclose(v, v_ref * n_k / n_full, rtol=1e-10)
            np.testing.assert_allclose(g, g_ref * n_k / n_full, rtol=1e-10, atol=1e-14)
            total += v
        if kind == "kl_cov":  # not the full-batch loss: each micro-batch penalises its own top-k
            assert abs(total - _vg(term, lp, batch)[0]) > 1e-6


def test_covariance_terms_are_micro_batch_exact_when_the_selection_is_fixed():
    # KL-Cov with ratio 1 penalises every token; Clip-Cov with ratio 1 and unbounded covariance
    # bounds zeroes every unclipped token: no statistic matters, split_batch is exact.
    lp, batch = _random_batch(4, spread=0.3)
    for term in (
        losses.kl_cov(kl_cov_ratio=1.0),
        losses.clip_cov(clip_cov_ratio=1.0, clip_cov_lb=-1e300, clip_cov_ub=1e300),
    ):
        v_full, _, g_full = _vg(term, lp, batch)
        parts = [
            _vg(term, lp[sl], part)
            for sl, part in zip(losses.row_slices(4, 3), losses.split_batch(batch, 3), strict=True)
        ]
        assert sum(p[0] for p in parts) == pytest.approx(v_full, rel=1e-12, abs=1e-15)
        np.testing.assert_allclose(np.concatenate([p[2] for p in parts]), g_full, rtol=1e-12)


def test_vespo_worked_example():
    # §3.2: Σ_t (p - q) = 0.3 → φ = 0.63790 (A = +1), 1.22175 (A = -1); gradient -φ·A.
    lp = np.full((2, 3), -1.0)
    batch = losses.Batch(
        action_mask=np.ones((2, 3)), advantages=np.array([1.0, -1.0]), sampling_logprobs=lp - 0.1
    )
    value, metrics, grad = _vg(losses.vespo(reduction="token_sum"), lp, batch)
    np.testing.assert_allclose(grad, [[-0.63790] * 3, [1.22175] * 3], atol=6e-6)
    np.testing.assert_allclose(value, 3 * (0.63790 - 1.22175), atol=2e-5)
    assert metrics["seq_weight_mean"] == pytest.approx(math.exp(0.3), rel=1e-12)
    # φ(1) = 1: on-policy VESPO is REINFORCE.
    _, _, g0 = _vg(losses.vespo(reduction="token_sum"), lp, batch.replace(old_logprobs=lp))
    np.testing.assert_array_equal(g0, [[-1.0] * 3, [1.0] * 3])


def test_vespo_folds_a_token_correction_into_the_sequence_weight():
    # TRL adds Σ log clamp(IS_vllm) to log w and does not multiply the IS weight again.
    lp, batch = _random_batch(5, b=2, t=3, p_mask=1.0, per_token_adv=False)
    old = np.asarray(batch.sampling_logprobs)
    sampling = old + np.array([[0.2, -0.1, 0.0], [0.5, 0.1, -0.3]])
    batch = losses.Batch(
        action_mask=np.ones((2, 3)),
        advantages=np.array([0.7, -1.3]),
        old_logprobs=old,
        sampling_logprobs=sampling,
    )
    cap = 1.1
    corr = losses.mismatch_correction(kind="tis", level="token", cap=cap)
    _, _, grad = _vg(losses.vespo(reduction="token_sum", correction=corr), lp, batch)
    c = np.minimum(np.exp(old - sampling), cap)
    log_w = np.sum(lp - old + np.log(c), axis=1)
    adv = np.array([0.7, -1.3])
    k = np.where(adv >= 0, 2.0, 3.0)
    lam = np.where(adv >= 0, 3.0, 2.0)
    phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
    np.testing.assert_allclose(grad, np.repeat((-phi * adv)[:, None], 3, axis=1), rtol=1e-12)
    for bad in (
        losses.mismatch_correction(kind="tis", level="sequence", cap=2.0),
        losses.mismatch_correction(kind="opsm", delta=0.1),
    ):
        with pytest.raises(ValueError, match="vespo: the correction must be token-level"):
            losses.vespo(correction=bad)


def test_luspo_worked_example_and_the_gspo_identity():
    # §3.2: s = exp(mean[0.1, 0.3]) = 1.22140 > 1.2 with A = +1: loss -2.4, gradient 0.
    lp = np.array([[-1.0, -1.0]])
    batch = losses.Batch(
        action_mask=np.ones((1, 2)), advantages=np.array([1.0]), sampling_logprobs=lp - [0.1, 0.3]
    )
    value, metrics, grad = _vg(losses.luspo(clip_low=0.2, clip_high=0.2), lp, batch)
    assert value == pytest.approx(-2.4, rel=1e-12)
    np.testing.assert_array_equal(grad, 0.0)
    assert metrics["seq_ratio_mean"] == pytest.approx(1.22140, abs=6e-6)
    # LUSPO = uncapped GSPO (TRL has no ≤ 10 clamp) with the seq_mean_token_sum reduction.
    lp, batch = _random_batch(6, spread=0.5, per_token_adv=False)
    a = _vg(losses.luspo(clip_low=0.1, clip_high=0.1), lp, batch)
    b = _vg(
        losses.gspo(
            clip_low=0.1, clip_high=0.1, seq_ratio_log_cap=20.0, reduction="seq_mean_token_sum"
        ),
        lp,
        batch,
    )
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[2], b[2])


def test_luspo_weights_each_sequence_by_its_length_not_length_squared():
    # TRL before PR #6654: mean((ℓ·N_i)) over the padded [B, T] array weighted sequence i by
    # N_i²/T once ℓ was broadcast to tokens. Ours: (1/N) Σ_i N_i·ℓ_i, whatever the padding.
    lp = np.full((2, 5), -1.0)
    mask = np.array([[1.0, 0, 0, 0, 0], [1.0, 1, 1, 0, 0]])
    old = lp - 0.05
    batch = losses.Batch(action_mask=mask, advantages=np.array([1.0, -2.0]), sampling_logprobs=old)
    value, _, _ = _vg(losses.luspo(clip_low=0.5, clip_high=0.5), lp, batch)
    s = math.exp(0.05)
    ell = [-1.0 * s, 2.0 * s]
    assert value == pytest.approx((1 * ell[0] + 3 * ell[1]) / 2, rel=1e-12)
    defective = (1 * ell[0] + 9 * ell[1]) / (2 * 5)
    assert abs(value - defective) > 0.5


def test_two_sided_delta_worked_example():
    # §3.3: r = 5, A = -1, ε = 0.2, δ = 4: loss 4, gradient 0. No delta: 5 and 5; dual clip 3: 3.
    lp, batch = _one_token_rows([math.log(0.5)], [math.log(0.1)], [-1.0])
    for term, loss, grad in (
        (losses.grpo(delta=4.0, reduction="token_sum"), 4.0, 0.0),
        (losses.grpo(reduction="token_sum"), 5.0, 5.0),
        (losses.grpo(dual_clip=3.0, reduction="token_sum"), 3.0, 0.0),
        # GSPO-token with one token: s = r.
        (losses.gspo(clip_low=0.2, clip_high=0.2, delta=4.0, reduction="token_sum"), 4.0, 0.0),
        (losses.luspo(clip_low=0.2, clip_high=0.2, delta=4.0), 4.0, 0.0),
    ):
        v, _, g = _vg(term, lp, batch)
        assert v == pytest.approx(loss, rel=1e-12)
        assert float(g[0, 0]) == pytest.approx(grad, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("seed", range(3))
def test_delta_at_or_above_the_upper_bound_is_the_dual_clip(seed):
    lp, batch = _random_batch(seed, spread=0.6)
    a = _vg(losses.grpo(delta=1.7, clip_high=0.28), lp, batch)
    b = _vg(losses.grpo(dual_clip=1.7, clip_high=0.28), lp, batch)
    assert a[0] == pytest.approx(b[0], rel=1e-12)
    np.testing.assert_allclose(a[2], b[2], rtol=1e-12, atol=1e-15)
    assert losses.builtin_twin(losses.grpo(delta=1.7, clip_high=0.28)) == (
        "dapo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "eps_clip_c": 1.7},
    )


def _delta_zero(a, r, lo, hi, delta):
    return ((a > 0) & (r > min(hi, delta))) | ((a < 0) & ((r < lo) | (r > max(hi, delta))))


@pytest.mark.parametrize(
    "make, sequence",
    [
        (lambda: losses.grpo(delta=1.15, clip_high=0.3, reduction="token_sum"), False),
        (lambda: losses.grpo(delta=1.6, clip_high=0.3, reduction="token_sum"), False),
        (lambda: losses.gspo(clip_low=0.2, clip_high=0.3, delta=1.1, reduction="token_sum"), True),
        (lambda: losses.luspo(clip_low=0.2, clip_high=0.3, delta=1.5), True),
    ],
    ids=["grpo-two-sided", "grpo-dual", "gspo", "luspo"],
)
def test_delta_zero_gradient_exactly_where_derived(make, sequence):
    # -min(min(r, δ)·A, clip(r)·A): flat for A > 0 beyond min(hi, δ) (two-sided when δ < hi),
    # for A < 0 below lo and beyond max(hi, δ). Sequence terms use s_i for r.
    term = make()
    lo, hi = 0.8, 1.3
    delta = term.config["delta"]
    seen = np.zeros(2, bool)
    for seed in range(6):
        lp, batch = _random_batch(seed, spread=1.0 if sequence else 0.4)
        _, _, grad = _vg(term, lp, batch)
        m = np.asarray(batch.action_mask) > 0
        d = lp - np.asarray(batch.sampling_logprobs)
        if sequence:
            d = np.repeat(((d * m).sum(1) / m.sum(1))[:, None], d.shape[1], axis=1)
        zero = _delta_zero(np.asarray(batch.advantages), np.exp(d), lo, hi, delta) & m
        seen |= [zero.any(), (m & ~zero).any()]
        assert np.all(grad[zero] == 0.0) and np.all(grad[m & ~zero] != 0.0)
    assert seen.all()
    if delta < hi:  # two-sided: no kernel
        assert losses.builtin_twin(term) is None


def test_gspo_without_the_verl_cap_is_trl_gspo_token():
    # TRL's GSPO-token has no ≤ 10 clamp on log s_it; seq_ratio_log_cap ≥ max_log_ratio never
    # binds. A row whose mean log-ratio is 12 keeps its gradient only without the cap.
    lp, batch = _one_token_rows([-1.0], [-13.0], [-1.0])
    capped = _vg(losses.gspo(reduction="token_sum"), lp, batch)[2]
    trl = _vg(losses.gspo(seq_ratio_log_cap=20.0, reduction="token_sum"), lp, batch)[2]
    assert float(capped[0, 0]) == 0.0
    assert float(trl[0, 0]) == pytest.approx(math.exp(12.0), rel=1e-12)


def test_dppo_tv_kl_worked_example():
    # §3.4: μ = 0.5, p = [0.8, 0.6, 0.25], A = [1, 1, -1]: keep [0, 1, 0], r = [1.6, 1.2, 0.5].
    lp = np.log([[0.8, 0.6, 0.25]])
    batch = losses.Batch(
        action_mask=np.ones((1, 3)),
        advantages=np.array([[1.0, 1.0, -1.0]]),
        sampling_logprobs=np.log(np.full((1, 3), 0.5)),
    )
    value, metrics, grad = _vg(losses.dppo_tv_kl(reduction="token_sum"), lp, batch)
    assert value == pytest.approx(-1.19927, abs=6e-6)
    np.testing.assert_allclose(grad, [[0.00094, -1.19964, -0.00139]], atol=6e-6)
    assert metrics["mask_frac"] == pytest.approx(2 / 3)
    assert metrics["pg_loss"] == pytest.approx(-1.2, rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_dppo_tv_kl_without_kl_is_binary_tv_dppo(seed):
    # Same masks for δ_lo = δ_hi = δ (A = 0 tokens contribute nothing either way).
    lp, batch = _random_batch(seed, spread=0.5)
    for delta in (0.05, 0.15):
        a = _vg(losses.dppo_tv_kl(mask_low=delta, mask_high=delta, kl_tau=0.0), lp, batch)
        b = _vg(losses.dppo(threshold=delta), lp, batch)
        assert a[0] == pytest.approx(b[0], rel=1e-12)
        np.testing.assert_allclose(a[2], b[2], rtol=1e-12, atol=1e-15)
        assert a[1]["mask_frac"] == b[1]["mask_frac"]


def test_dppo_tv_kl_is_anchored_on_the_sampler():
    # prime-rl has no old-policy recompute: old_logprobs is not read.
    lp, batch = _random_batch(7, spread=0.5)
    term = losses.dppo_tv_kl(kl_tau=0.1)
    assert "old_logprobs" not in term.reads and "sampling_logprobs" in term.requires
    a = _vg(term, lp, batch)
    b = _vg(term, lp, batch.replace(old_logprobs=np.asarray(batch.sampling_logprobs) - 1.0))
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[2], b[2])
    assert losses.builtin_twin(term) is None


NEW_TERMS = [
    ("clip_cov", lambda: losses.clip_cov(clip_cov_lb=-1.0, clip_cov_ub=1.0)),
    ("kl_cov", lambda: losses.kl_cov(kl_cov_ratio=0.3)),
    ("vespo", lambda: losses.vespo(reduction="seq_mean_token_mean")),
    ("luspo", lambda: losses.luspo(clip_low=0.2, clip_high=0.2)),
    ("dppo_tv_kl", lambda: losses.dppo_tv_kl(kl_tau=0.1)),
    ("grpo-delta-iw", lambda: losses.grpo(delta=1.1, kl_coef=0.1, kl_importance_weight=True)),
]


@pytest.mark.parametrize("name, make", NEW_TERMS, ids=[n for n, _ in NEW_TERMS])
def test_new_terms_read_exactly_their_declared_fields(name, make):
    # The rule of tests/test_batch.py (DECLARED), for this task's terms.
    from tests.test_batch import _changed, _outputs, _same, _variants

    term = make()
    assert term.reads <= set(losses.FIELDS) and term.requires <= term.reads
    rng = np.random.default_rng(0)
    lp, variants = _variants(rng)
    bases = [_outputs(term, lp, f) for f in variants]
    for field in losses.FIELDS:
        outs = [_outputs(term, lp, _changed(field, f, rng)) for f in variants]
        same = all(_same(o, b) for o, b in zip(outs, bases, strict=True))
        assert same != (field in term.reads), (name, field)


BAD_NEW = [
    (losses.clip_cov, dict(clip_cov_ratio=0.0), "clip_cov_ratio must be > 0.0"),
    (losses.clip_cov, dict(clip_cov_ratio=1.5), "clip_cov_ratio must be <= 1.0"),
    (losses.clip_cov, dict(clip_cov_lb=2.0, clip_cov_ub=1.0), "clip_cov_ub must be > clip_cov_lb"),
    (losses.clip_cov, dict(seed=-1), "seed must be an int"),
    (losses.clip_cov, dict(seed=1.5), "seed must be an int"),
    (losses.clip_cov, dict(clip_low=0.1, clip_low_threshold=0.9), "not both"),
    (losses.kl_cov, dict(kl_cov_ratio=-0.1), "kl_cov_ratio must be > 0.0"),
    (losses.kl_cov, dict(ppo_kl_coef=-1.0), "ppo_kl_coef must be >= 0.0"),
    (losses.vespo, dict(lambda_pos=0.0), "lambda_pos must be > 0.0"),
    (losses.vespo, dict(k_neg=-1.0), "k_neg must be >= 0.0"),
    (losses.luspo, dict(delta=1.0), "delta must be > 1.0"),
    (losses.luspo, dict(reduction="mean"), "unknown reduction 'mean'"),
    (losses.gspo, dict(delta="2"), "delta must be a number"),
    (losses.grpo, dict(delta=0.9), "delta must be > 1.0"),
    (losses.grpo, dict(delta=2.0, dual_clip=3.0), "give dual_clip or delta, not both"),
    (losses.dppo_tv_kl, dict(mask_low=-0.1), "mask_low must be >= 0.0"),
    (losses.dppo_tv_kl, dict(adv_tau=0.0), "adv_tau must be > 0.0"),
    (losses.dppo_tv_kl, dict(kl_tau=float("nan")), "kl_tau must be finite"),
]


@pytest.mark.parametrize(
    "ctor, kwargs, message", BAD_NEW, ids=[f"{c.__name__}-{m[:24]}" for c, _, m in BAD_NEW]
)
def test_new_constructors_reject_bad_hyperparameters(ctor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctor(**kwargs)


def test_new_twins():
    # LUSPO = GSPO with A_i·N_i (§8): the gspo kernel, its cap at 20 never binding; the others
    # have none (Clip-Cov/KL-Cov/VESPO custom; dppo_tv_kl's KL custom and its anchor is the
    # sampler; delta has no kernel key except as a dual clip).
    assert losses.builtin_twin(losses.luspo()) == (
        "gspo",
        {
            "clip_low_threshold": 1 - 3e-4,
            "clip_high_threshold": 1 + 4e-4,
            "seq_ratio_log_cap": 20.0,
        },
    )
    for term in (
        losses.clip_cov(),
        losses.kl_cov(),
        losses.vespo(),
        losses.dppo_tv_kl(),
        losses.dppo_tv_kl(kl_tau=0.0),
        losses.gspo(delta=2.0),
        losses.luspo(delta=2.0),
        losses.luspo(max_log_ratio=10.0),
        losses.grpo(delta=1.1),
    ):
        assert losses.builtin_twin(term) is None, term


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gmpo_holds_a_log_ratio_exactly_on_its_bound(sign):
    """A token whose log-ratio is exactly ``±ε`` (on the side its advantage clips) gets no
    gradient and counts as clipped, as the NumPy reference says (``jnp.maximum`` split the
    gradient in half there: a case hypothesis found)."""
    lp, old = np.full((1, 6), -1.0), np.full((1, 6), -1.0)
    # log-ratio p - q = -0.4·sign exactly in float64: on the bound its advantage clips
    lp[0, 5], old[0, 5] = (-1.0, -0.6) if sign > 0 else (-0.6, -1.0)
    batch = losses.Batch(
        action_mask=np.ones((1, 6)),
        advantages=np.array([-sign]),
        sampling_logprobs=old,
        old_logprobs=old,
    )
    assert (lp - old)[0, 5] == -sign * 0.4
    term = losses.gmpo()
    grad = np.asarray(jax.grad(lambda x: term(x, batch)[0])(jnp.asarray(lp)))
    ref_value, ref_grad = ref.policy_ref("gmpo", lp, batch)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert grad[0, 5] == 0.0 and np.all(grad[0, :5] != 0.0)
    assert float(term(jnp.asarray(lp), batch)[1]["clip_frac"]) == pytest.approx(1 / 6)
